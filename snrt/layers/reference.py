"""The layer reference, written from the registry so that it cannot drift from the code: every
layer type with its description, options (type and default), inputs, and what its backward
keeps alive (which the scheduler's liveness, recomputation and offload plans rely on).

    python -m snrt.layers.reference > docs/layers.md
"""

import dataclasses
import inspect

from snrt.layers import LAYERS
from snrt.layers.base import CHEAP


def layer_reference():
    """The reference as Markdown text."""
    lines = ["# Layer reference", "",
             "Every `type:` a network file can use, generated from the layer registry "
             "(`python -m snrt.layers.reference > docs/layers.md`; a test keeps this file equal to it). "
             "Shapes are batch first. *Backward keeps* is what a layer's backward step reads besides the "
             "gradient of its output: the scheduler keeps exactly that alive (or offloads or recomputes "
             "it) until the step runs. In bf16 and fp16 runs (`train.precision`, snrt/precision.py) outputs and "
             "their gradients are stored in 2 bytes unless the layer keeps fp32; parameters, optimizer state and "
             "normalization statistics are fp32 in every precision.", ""]
    for name in sorted(LAYERS):
        lines += _entry(LAYERS[name])
    return "\n".join(lines) + "\n"


def _entry(cls):
    doc = inspect.getdoc(cls) or ""
    lines = [f"## {cls.type_name}", "", doc, ""]
    options = [f for f in dataclasses.fields(cls)]
    if options:
        lines += ["| option | type | default |", "| --- | --- | --- |"]
        for f in options:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = "required" if required else f"`{_plain(f.default)}`"
            lines.append(f"| `{f.name}` | {_type_name(f.type)} | {default} |")
        lines.append("")
    lines += [f"- inputs: {_arity(cls)}",
              f"- backward keeps: {_saves(cls)}",
              f"- when memory is short: {'recomputed from its input' if cls.recompute_cost == CHEAP else 'kept (its output is a checkpoint)'}",
              f"- in bf16 and fp16 runs: {_precision(cls)}",
              ""]
    return lines


def _precision(cls):
    if cls.keeps_fp32:
        return "output and saved tensors in fp32"
    kept = f", saved {' and '.join(f'`{a}`' for a in cls.fp32_aux)} in fp32" if cls.fp32_aux else ""
    return f"output stored in 2 bytes{kept}"


def _arity(cls):
    low, high = cls.min_inputs, cls.max_inputs
    if high is None:
        return f"{low} or more"
    return f"{low}" if low == high else f"{low} to {high}"


def _saves(cls):
    saves = cls.saves
    kept = [f"input {i}" for i in saves.inputs] + (["its output"] if saves.output else [])
    return ", ".join(kept) if kept else "nothing"


def _type_name(annotation):
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("tuple", "pair").replace(" | NoneType", " or none").replace(" | ", " or ")


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


if __name__ == "__main__":
    print(layer_reference(), end="")
