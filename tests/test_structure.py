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
    allowed = {"cupy_backend.py", "cuda_source.py", "cudnn_graphs.py", "cuda_rates.py", "__init__.py"}
    for path in sorted(SNRT.rglob("*.py")):
        uses = [m for m in imported_modules(path) if m.split(".")[0] in ("cupy", "cupyx", "cudnn")]
        if uses:
            assert path.parent.name == "backends" and path.name in allowed, f"{path} imports {uses}"


def module_graph():
    """{module: modules of snrt it imports (at any depth of its code, functions included)}."""
    modules = {".".join(p.relative_to(SNRT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in SNRT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from pkg import module` names the module
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_module_imports_in_a_circle():
    graph = module_graph()

    def reaches(start, target, seen):
        for d in graph[start]:
            if d == target or (d not in seen and (seen.add(d) or reaches(d, target, seen))):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_layering():
    """The scheduler never sees the config layer, the backends or the executor; memory/ is the
    run-time arena and host store and imports no planning code; backends never reach up to the
    executor, the trainer or the config."""
    rules = {
        "snrt.scheduler": ("snrt.config", "snrt.backends", "snrt.executor", "snrt.runtime", "snrt.train", "snrt.memory"),
        "snrt.memory": ("snrt.scheduler", "snrt.config", "snrt.backends", "snrt.executor"),
        "snrt.backends": ("snrt.executor", "snrt.runtime", "snrt.train", "snrt.config", "snrt.cli"),
        "snrt.executor": ("snrt.config", "snrt.train", "snrt.runtime", "snrt.cli"),
    }
    for module, deps in module_graph().items():
        for package, forbidden in rules.items():
            if module == package or module.startswith(package + "."):
                bad = sorted(d for d in deps if d.startswith(forbidden))
                assert not bad, f"{module} imports {bad}"


def test_no_private_names_imported_across_modules():
    for path in sorted(SNRT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("snrt"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private {private} from {node.module}"
