"""Backends: the only code that knows numpy from cupy (device arena, host store, streams)."""
