"""Errors users see. Each one says where (file, key path or node) and what was expected."""


class SnrtError(Exception):
    """Base class of every error snrt reports to a user without a traceback."""


class ConfigError(SnrtError):
    """A YAML network or training section is wrong.

    `source` is the file (or "<dict>"), `key` a path such as
    ``network[12].block.bottleneck.layers[3].kernel``, `message` what was expected.
    """

    def __init__(self, source, key, message):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}" if key else str(source)
        super().__init__(f"{where}: {message}")


class GraphError(SnrtError):
    """A graph cannot be built: unknown input, cycle, wrong arity or shape mismatch.

    `node` names the node at fault; `key` (optional) is the YAML key path it came from.
    """

    def __init__(self, node, message, key=None):
        self.node, self.message, self.key = node, message, key
        super().__init__(f"node '{node}': {message}")


class ShapeError(SnrtError):
    """Raised by a layer's `infer_shape` when its input shapes are not what it accepts.

    The graph re-raises it as a GraphError that names the node.
    """


class DivergenceError(SnrtError):
    """Training produced a NaN or infinite loss: the run stops, and the last good checkpoint stays."""
