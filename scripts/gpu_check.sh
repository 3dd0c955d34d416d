#!/usr/bin/env bash
# The GPU check: one command, on a machine with an NVIDIA GPU, that says whether snrt's CUDA
# backend is correct there and how fast it is. It writes results/gpu_check.md and
# results/gpu_check.json (every number, the device, the software versions) and prints a
# short table last. Where no GPU is usable it says so in one line and exits 0.
#
#     bash scripts/gpu_check.sh                       # in the Python environment it is started in
#     bash scripts/gpu_check.sh --venv gpu-cuda13     # a fresh venv with that extra (needs network)
#     bash scripts/gpu_check.sh --no-bench            # the tests only
#     bash scripts/gpu_check.sh --no-rest             # the backend tests only (CI runs the rest)
#     bash scripts/gpu_check.sh --seconds 300         # end within 300 s (default 540)
#
# By default it uses the Python environment it is started in (`python3`, or $PYTHON): CuPy,
# cuDNN and, for the comparison, PyTorch with torchvision already installed, the checkout put
# on the path. A machine without network may lack the cuDNN frontend: on a machine with
# network, `bash scripts/fetch_gpu_wheels.sh` downloads it into .wheels/ of the checkout, and
# the check installs every wheel found there into .wheels/site first.
#
# Stages, each time-boxed (a stage that fails or runs out of time is recorded, and the others
# still run), in this order: the environment and device; tests/backends and the rest of the suite,
# side by side (pytest-xdist); ResNet-50 batch 32 at 224x224 under every policy (bench_gpu.py,
# each iteration after the second a replayed CUDA graph); PyTorch's ResNet-50 at the same batch
# (bench_torch.py: fp32 with TF32 off, then PyTorch's defaults, each also with
# checkpoint_sequential, then bf16 autocast channels_last); none and superneurons step by step
# (--no-cuda-graph); snrt's policy auto in half the memory PyTorch's checkpoint_sequential took;
# ResNet-50 in tf32, then in bf16, under none and superneurons; five iterations of `snrt train
# configs/resnet2500.yaml --backend cuda` at its own settings; ResNet-50 under none with cuDNN's
# non-deterministic engines admitted, and unfused (--no-fuse) under none and superneurons; four
# iterations of ResNet-2500 under liveness, no budget to speak of (the last stage: what compute
# alone allows it). The report opens with the targets of the GPU work, measured or not. On one H100 the
# whole check took under 5 minutes before cuDNN's engines were timed; on one H200 a first run
# (engines timed, 2026-11-27) did not finish in 430 s without the rest of the suite: the engine
# choices are kept in the cache folder for the next run (SNRT_CACHE_DIR moves it). With them kept,
# `--no-rest --seconds 450` ran every stage in 7 min 30 s on one H200 (2026-11-28).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bench=1
rest=1
venv_extra=""
seconds=540  # the whole check's time: a stage gets at most what is left, and none starts with under 15 s
while (( $# )); do
    case "$1" in
        --no-bench) bench=0; shift ;;
        --no-rest) rest=0; shift ;;
        --venv) venv_extra="${2:?--venv needs an extra: gpu (CUDA 12) or gpu-cuda13}"; shift 2 ;;
        --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
        *) echo "usage: bash scripts/gpu_check.sh [--venv gpu|gpu-cuda13] [--no-bench] [--no-rest] [--seconds N]" >&2; exit 2 ;;
    esac
done
deadline=$(( SECONDS + seconds - 15 ))  # 15 s kept for the report

python="${PYTHON:-python3}"
if [[ -n "$venv_extra" ]]; then
    venv="${TMPDIR:-/tmp}/snrt-gpu-check-venv"
    python3 -m venv "$venv" && "$venv/bin/pip" install --quiet --upgrade pip &&
        "$venv/bin/pip" install --quiet -e ".[$venv_extra,test,bench]" || { echo "gpu_check: could not install .[$venv_extra,test,bench]"; exit 1; }
    python="$venv/bin/python"
else
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! reason=$("$python" -c "
from snrt.backends import cuda_unavailable_reason
print(cuda_unavailable_reason() or '')" 2>&1); then
    echo "gpu_check: no GPU check here: snrt does not import ($reason)"
    exit 0
fi
if [[ -n "$reason" ]]; then
    echo "gpu_check: no GPU here, nothing checked: $reason"
    exit 0
fi
if [[ -z "$venv_extra" ]] && compgen -G ".wheels/*.whl" > /dev/null; then
    if "$python" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target .wheels/site .wheels/*.whl \
            > .wheels/install.log 2>&1; then
        export PYTHONPATH="$root:$root/.wheels/site${PYTHONPATH#"$root"}"
    else
        echo "gpu_check: could not install the wheels in .wheels/ (see .wheels/install.log); going on without them"
    fi
fi

work="${TMPDIR:-/tmp}/snrt-gpu-check"
rm -rf "$work" && mkdir -p "$work"
cores=$(nproc)

run_stage() {  # NAME SECONDS COMMAND...: run it time-boxed, log to $work/NAME.log, record rc and seconds
    local name=$1 seconds=$2
    shift 2
    local left=$(( deadline - SECONDS ))
    if (( left < 15 )); then  # recorded with exit -1: the report says the check's time ran out before it
        echo "$name -1 0 $seconds" >> "$work/stages.txt"
        echo "== $name: skipped, the check's time is spent"
        return
    fi
    (( seconds > left )) && seconds=$left
    local start=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $(( SECONDS - start )) $seconds" >> "$work/stages.txt"
    echo "== $name: exit $rc after $(( SECONDS - start )) s (limit $seconds s)"
    tail -n 4 "$work/$name.log"
}

run_stage environment 60 "$python" -c "
import json, platform, sys
from snrt.backends import backend_class
backend_class('cuda')  # refuses a GPU older than the toolkit supports, naming both
from snrt.backends.cupy_backend import device_summary
info = {'device': device_summary(), 'python': sys.version.split()[0], 'platform': platform.platform()}
try:
    import torch, torchvision
    info['torch'] = f'{torch.__version__} (torchvision {torchvision.__version__})'
except ImportError as e:
    info['torch'] = f'not installed ({e})'
print(json.dumps(info))
json.dump(info, open('$work/environment.json', 'w'))"

# The two test runs share the machine: the backend tests need the GPU, the rest only cores.
backend_workers=$(( cores > 8 ? 6 : 2 ))
rest_workers=$(( cores > 8 ? cores - backend_workers : 2 ))
run_stage tests-backends 200 "$python" -m pytest -n "$backend_workers" tests/backends -q -rs -p no:cacheprovider \
    --junitxml "$work/tests-backends.xml" &
if (( rest )); then
    run_stage tests-rest 200 "$python" -m pytest -n "$rest_workers" -q -p no:cacheprovider --ignore tests/backends \
        --junitxml "$work/tests-rest.xml" &
fi
wait

# Data parallel on NCCL needs a GPU per rank: with two or more, two ranks train a few iterations
# on the GPUs and must agree with two ranks on the CPU (MPI) to float tolerance.
data_parallel() {
    for backend in cuda cpu; do
        mpiexec -n 2 "$python" -m snrt train configs/cifar_resnet20.yaml --backend "$backend" --batch 16 \
            --iterations 5 --no-eval --no-progress --out "$work/dp/$backend" || return 1
    done
    "$python" - "$work/dp" <<'PY'
import sys
import numpy as np
from snrt.checkpoint import load_checkpoint
gpu, _ = load_checkpoint(f"{sys.argv[1]}/cuda/checkpoint.npz")
cpu, _ = load_checkpoint(f"{sys.argv[1]}/cpu/checkpoint.npz")
worst = max(float(np.abs(gpu[k] - cpu[k]).max() / (np.abs(cpu[k]).max() + 1e-12)) for k in cpu)
print(f"NCCL on GPUs vs MPI on the CPU, 2 ranks: largest relative difference {worst:.2e}")
assert worst < 1e-3, worst
PY
}
export -f data_parallel
export python work
gpus=$("$python" -c "from cupy.cuda import runtime; print(runtime.getDeviceCount())")
if (( gpus >= 2 )) && command -v mpiexec > /dev/null; then
    run_stage data-parallel 120 bash -c data_parallel
fi

if (( bench )); then  # what most targets need first, the variants last (skipped first when time runs short)
    run_stage bench-snrt 180 "$python" scripts/bench_gpu.py --out "$work/bench-snrt.json" --figures results
    run_stage bench-torch 90 "$python" scripts/bench_torch.py --out "$work/bench-torch.json"
    run_stage bench-snrt-stepwise 90 "$python" scripts/bench_gpu.py --no-cuda-graph --policies none superneurons \
        --out "$work/bench-snrt-stepwise.json"
    # snrt's fastest plan (policy auto) in half the memory of PyTorch with checkpoint_sequential
    if half=$("$python" -c "
import json
rows = {r['mode']: r for r in json.load(open('$work/bench-torch.json'))['rows'] if 'error' not in r}
print(rows['fp32+checkpoint']['peak_bytes'] // 2)" 2> /dev/null); then
        run_stage bench-snrt-auto 90 "$python" scripts/bench_gpu.py --policies auto --budget "$half" \
            --out "$work/bench-snrt-auto.json"
    fi
    run_stage bench-snrt-tf32 90 "$python" scripts/bench_gpu.py --precision tf32 --policies none superneurons \
        --out "$work/bench-snrt-tf32.json"
    run_stage bench-snrt-bf16 90 "$python" scripts/bench_gpu.py --precision bf16 --policies none superneurons \
        --out "$work/bench-snrt-bf16.json"
    run_stage resnet2500 200 "$python" -m snrt train configs/resnet2500.yaml --backend cuda --iterations 5 --no-eval \
        --no-progress --out "$work/resnet2500"
    run_stage bench-snrt-nondeterministic 60 "$python" scripts/bench_gpu.py --nondeterministic --policies none \
        --out "$work/bench-snrt-nondeterministic.json"
    run_stage bench-snrt-unfused 90 "$python" scripts/bench_gpu.py --no-fuse --policies none superneurons \
        --out "$work/bench-snrt-unfused.json"
    # ResNet-2500 with no memory policy to speak of (liveness, about 43 GiB planned): the iteration
    # time compute alone allows, what the ResNet-2500 target is to be read against
    run_stage resnet2500-liveness 120 "$python" -m snrt train configs/resnet2500.yaml --backend cuda --policy liveness \
        --budget 70GiB --iterations 4 --no-eval --no-progress --out "$work/resnet2500-liveness"
fi

"$python" scripts/gpu_report.py "$work" --out results/gpu_check
