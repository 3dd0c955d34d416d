"""The suite runs under pytest-xdist (`pytest -n N`): every worker collects the tests itself and
they must agree on every node id, so no id may hold what changes from one process to the next."""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # a repr's `<... at 0x7f...>`, an id() printed in hex


def collected_node_ids():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (f"collection failed (exit {done.returncode}):\n"
                                  f"{done.stdout[-4000:]}{done.stderr[-4000:]}")
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids, f"no tests collected:\n{done.stdout[-4000:]}"
    return ids


def test_node_ids_hold_no_memory_address_and_are_unique():
    ids = collected_node_ids()
    with_address = [i for i in ids if ADDRESS.search(i)]
    assert not with_address, (f"{len(with_address)} node ids hold a memory address (give the parametrize "
                              f"`ids=`), e.g.:\n" + "\n".join(with_address[:10]))
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    assert not repeated, "node ids collected more than once:\n" + "\n".join(repeated[:10])
