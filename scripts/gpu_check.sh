#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and driver: one command that installs snrt
# with its gpu and test extras into a fresh virtual environment, says which device it found,
# runs the backend test suite (the static checks and the device tests: layer-by-layer parity
# with the NumPy kernels, training under every policy against the CPU, measured peak equal
# to the planned peak, no allocation outside the arena while kernels run, copy/compute
# overlap in CUDA event timings), then the whole test suite with the cuda backend importable,
# then two data-parallel ranks on NCCL where there are two GPUs, then the GPU benchmark
# (results/bench_gpu.json).
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
# Data parallel on NCCL needs a GPU per rank: with two or more, two ranks train a few
# iterations on the GPUs and must agree with two ranks on the CPU (MPI) to float tolerance.
gpus=$("$venv/bin/python" -c "from cupy.cuda import runtime; print(runtime.getDeviceCount())")
if (( gpus >= 2 )); then
    out="${TMPDIR:-/tmp}/snrt-gpu-check-dp"
    rm -rf "$out"
    for backend in cuda cpu; do
        "$venv/bin/mpiexec" -n 2 "$venv/bin/snrt" train configs/cifar_resnet20.yaml --backend "$backend" --batch 16 \
            --iterations 5 --no-eval --no-progress --out "$out/$backend"
    done
    "$venv/bin/python" - "$out" <<'PY'
import sys
import numpy as np
from snrt.checkpoint import load_checkpoint
gpu, _ = load_checkpoint(f"{sys.argv[1]}/cuda/checkpoint.npz")
cpu, _ = load_checkpoint(f"{sys.argv[1]}/cpu/checkpoint.npz")
worst = max(float(np.abs(gpu[k] - cpu[k]).max() / (np.abs(cpu[k]).max() + 1e-12)) for k in cpu)
print(f"data parallel, 2 ranks: NCCL on GPUs vs MPI on the CPU, largest relative difference {worst:.2e}")
assert worst < 1e-3, worst
PY
else
    echo "gpu_check: data parallel on NCCL skipped: it needs two GPUs, this machine has $gpus"
fi
if (( bench )); then
    "$venv/bin/python" scripts/bench_gpu.py
fi
