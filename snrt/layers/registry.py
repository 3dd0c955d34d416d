"""Layer registry: YAML `type:` names to layer classes."""

LAYERS = {}


def register(cls):
    """Class decorator: make `cls` available under `cls.type_name`."""
    if cls.type_name in LAYERS:
        raise ValueError(f"layer type '{cls.type_name}' registered twice")
    LAYERS[cls.type_name] = cls
    return cls
