"""Device memory at run time: the arena every tensor is a view of, and the host store that
holds offloaded tensors. Where each buffer goes is planned by snrt/scheduler/offsets.py."""
