"""The README's Python example runs as written (docs that drift from the code are a bug)."""

import contextlib
import io
import re
from pathlib import Path

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
