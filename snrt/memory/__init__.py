"""The unified tensor pool: offset assignment in the device arena and the host store."""
