"""The layer reference in docs/ is the registry's own account of itself."""

from pathlib import Path

from snrt.layers import LAYERS
from snrt.layers.reference import layer_reference

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "layers.md"


def test_docs_layers_md_is_generated_from_the_registry():
    assert DOCS.read_text() == layer_reference(), "regenerate: python -m snrt.layers.reference > docs/layers.md"


def test_the_reference_names_every_layer_its_required_options_and_what_backward_keeps():
    text = layer_reference()
    for name in LAYERS:
        assert f"\n## {name}\n" in text
    conv = text.split("\n## Conv2d\n")[1].split("\n## ")[0]
    assert "| `out_channels` | int | required |" in conv and "- backward keeps: input 0" in conv
    mul = text.split("\n## Mul\n")[1].split("\n## ")[0]
    assert "- inputs: 2\n" in mul and "- backward keeps: input 0, input 1" in mul
