"""Architecture rules that code review alone would let slip."""

import ast
from pathlib import Path

SNRT = Path(__file__).resolve().parent.parent / "snrt"


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_the_scheduler_never_imports_numpy_or_cupy():
    for path in sorted((SNRT / "scheduler").glob("*.py")):
        bad = [m for m in imported_modules(path) if m.split(".")[0] in ("numpy", "cupy", "cupyx")]
        assert not bad, f"{path.name} imports {bad}"


def test_only_the_cuda_backend_imports_cupy():
    allowed = {"cupy_backend.py", "cuda_source.py", "cudnn_graphs.py", "__init__.py"}
    for path in sorted(SNRT.rglob("*.py")):
        uses = [m for m in imported_modules(path) if m.split(".")[0] in ("cupy", "cupyx", "cudnn")]
        if uses:
            assert path.parent.name == "backends" and path.name in allowed, f"{path} imports {uses}"
