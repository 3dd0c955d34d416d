"""The CPU kernels' effect on whole training iterations: snrt `none` before and after a change
and PyTorch (the same graph, `snrt.torch_reference.TorchNet`, NCHW), side by side in one run
per network (scripts/compare_speed.py: fresh processes, rounds taking turns).

Writes results/cpu_kernels.{json,md}.

    git worktree add /tmp/before <commit>        # the code to compare with
    python scripts/bench_cpu_kernels.py --before /tmp/before [--rounds 3]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from compare_speed import TAG
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table

HERE = Path(__file__).resolve().parent
CASES = [("mobilenet_v2", 64, 8), ("efficientnet_b0", 64, 8), ("convnext_tiny", 64, 8), ("resnet50", 112, 8),
         ("cifar_resnet110", 32, 32), ("cifar_resnet164", 32, 16)]


def compared(before, name, size, batch, rounds):
    """compare_speed.py's medians for one network: {"seconds": {"torch", "before none", "after none"}, ...}."""
    command = [sys.executable, str(HERE / "compare_speed.py"), "--before", before, name, str(size), str(batch),
               "--rounds", str(rounds), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    print("\n".join(line for line in out.splitlines() if not line.startswith(TAG)), flush=True)
    return json.loads(next(line for line in out.splitlines() if line.startswith(TAG))[len(TAG):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    meta = machine()
    before = subprocess.run(["git", "-C", args.before, "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()[:60]
    os.environ["SNRT_CACHE_DIR"] = tempfile.mkdtemp(prefix="snrt-bench-")  # kernel choices measured afresh
    rows = [compared(args.before, *case, args.rounds) for case in CASES]
    save_json(RESULTS, "cpu_kernels", {"meta": meta, "before": before, "rows": rows})
    save_markdown(RESULTS, "cpu_kernels", [
        "# CPU kernels: whole training iterations against PyTorch", "",
        meta_line(meta, False), "",
        f"`python scripts/bench_cpu_kernels.py --before CHECKOUT --rounds {args.rounds}` (before: `{before}`): "
        f"median seconds of one training iteration (policy none, fp32, synthetic data) over {args.rounds} rounds "
        "of 2 iterations after a warm-up, each side in fresh processes taking turns (scripts/compare_speed.py); "
        "PyTorch runs the same graph in NCHW (snrt.torch_reference.TorchNet) with the same optimizer. Both "
        f"sides ran with OPENBLAS_THREAD_TIMEOUT={os.environ.get('OPENBLAS_THREAD_TIMEOUT')} (set when this "
        "script imported snrt; the before checkout's processes inherit it), so after / before is the kernels' "
        "change alone (results/blas_timeout.md measures the timeout). Dense convolutions run the "
        "direct kernel where it measured at least 10% faster than im2col for their shape "
        "(snrt/backends/cpu_choice.py), measured afresh for this run.", "",
        *table(["network", "image", "batch", "PyTorch s", "before s", "after s", "after / before", "vs PyTorch before",
                "vs PyTorch after"],
               [[r["network"], r["size"], r["batch"], f"{r['seconds']['torch']:.3f}",
                 f"{r['seconds']['before none']:.3f}", f"{r['seconds']['after none']:.3f}",
                 f"{r['seconds']['after none'] / r['seconds']['before none']:.2f}",
                 f"{r['seconds']['torch'] / r['seconds']['before none']:.2f}x",
                 f"{r['seconds']['torch'] / r['seconds']['after none']:.2f}x"] for r in rows])])


if __name__ == "__main__":
    main()
