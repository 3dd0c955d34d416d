"""The host store: one byte array in host memory (pinned on CUDA) holding offloaded tensors,
each in the slot the plan gave it (`Buffer.host_slot`)."""


class HostStore:
    """`data` (a NumPy uint8 array, or None when the plan offloads nothing) carved into slots."""

    def __init__(self, data):
        self.data = data

    def slot(self, buffer):
        """The bytes of `buffer`'s slot (a view of `data`)."""
        if self.data is None or buffer.host_slot < 0:
            raise ValueError(f"buffer {buffer.name} has no slot in the host store")
        return self.data[buffer.host_slot:buffer.host_slot + buffer.nbytes]
