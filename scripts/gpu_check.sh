#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and driver: one command that installs snrt
# with its gpu and test extras into a fresh virtual environment, says which device it found,
# runs the backend test suite (the static checks and the device tests: layer-by-layer parity
# with the NumPy kernels, training under every policy against the CPU, measured peak equal
# to the planned peak, no allocation outside the arena while kernels run, copy/compute
# overlap in CUDA event timings), then the whole test suite with the cuda backend importable,
# then the GPU benchmark (results/bench_gpu.json).
#
#     bash scripts/gpu_check.sh            # everything
#     bash scripts/gpu_check.sh --no-bench # tests only
set -euo pipefail
cd "$(dirname "$0")/.."
bench=1
[[ "${1:-}" == "--no-bench" ]] && bench=0
venv="${TMPDIR:-/tmp}/snrt-gpu-check-venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -e '.[gpu,test]'
"$venv/bin/python" - <<'PY'
from snrt.backends import cuda_unavailable_reason
reason = cuda_unavailable_reason()
if reason is not None:
    raise SystemExit(f"gpu_check: no usable GPU here: {reason}")
from snrt.backends.cupy_backend import device_summary
print("device:", device_summary())
PY
# -rs lists every skip with its reason: on a GPU machine only the tests that wait for a
# change elsewhere (named in their reason) may skip.
"$venv/bin/python" -m pytest tests/backends -v -rs -p no:cacheprovider
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider
if (( bench )); then
    "$venv/bin/python" scripts/bench_gpu.py
fi
