"""The README as written: its Python example runs, and its first command plans within the RAM it
promises (docs that drift from the code are a bug)."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import snrt

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_python_example_runs(monkeypatch):
    text = README.read_text()
    section = text[text.index("## Networks in Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(README.parent)  # it loads configs/ by relative path
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    assert "['none', 'liveness', 'recompute', 'offload', 'superneurons'] 2147483648" in out.getvalue()


def test_the_first_command_plans_an_arena_within_the_ram_it_promises():
    """The README's first command trains ResNet2500 in "about 1 GB of RAM": the plan `snrt
    train` makes from its flags (on the CPU the device arena is RAM) stays under 1 GiB, with
    the parameters and momentum streamed from the host store on disk."""
    from snrt.cli import _overrides, build_parser
    from snrt.optim import make_optimizer

    first = README.read_text().split("```bash\n", 1)[1].splitlines()[0]
    program, *args = shlex.split(first.split("&&", 1)[1])
    assert program == "snrt" and args[0] == "train"
    parsed = build_parser().parse_args(args)
    config = snrt.load_config(README.parent / parsed.config, _overrides(parsed))
    assert config.memory.stream_parameters and config.memory.host_store
    plan = snrt.plan(config.graph, config.train.batch, config.memory.policy, budget=config.memory.budget,
                     stream_parameters=True, **make_optimizer(config.train.optimizer).plan_options)
    assert plan.arena_bytes <= 2**30
