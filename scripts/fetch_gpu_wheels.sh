#!/usr/bin/env bash
# On a machine with network: download the wheels a GPU machine without network may lack into
# .wheels/ (ignored by git), for scripts/gpu_check.sh to install from. By default the cuDNN
# frontend (the one package of the gpu extras a CUDA image with CuPy, cuDNN and PyTorch
# usually does not have) for the GPU machine's Python; more requirements may follow.
#
#     bash scripts/fetch_gpu_wheels.sh                        # for Python 3.12
#     bash scripts/fetch_gpu_wheels.sh 3.11 pytest-xdist==3.8.0
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
shift || true
frontend=$(grep -o '"nvidia-cudnn-frontend==[^"]*"' pyproject.toml | head -1 | tr -d '"')
mkdir -p .wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .wheels "$frontend" "$@"
ls -l .wheels/*.whl
