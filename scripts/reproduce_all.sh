#!/usr/bin/env bash
# Run every scripts/reproduce_*.py, then write README.md beside their result files.
#   bash scripts/reproduce_all.sh [--quick] [--out DIR]
# Options pass through to every script; results go to results/ (full) or results/quick/ (--quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
start=$(date +%s)
for script in peak_memory deepest_resnet largest_batch speed timeline; do
    t0=$(date +%s)
    echo "== reproduce_${script}.py $*"
    "$PYTHON" "scripts/reproduce_${script}.py" "$@"
    echo "== reproduce_${script}.py took $(( $(date +%s) - t0 )) s"
done
"$PYTHON" scripts/reproduce_summary.py "$@"
echo "== reproduce_all.sh $* took $(( $(date +%s) - start )) s"
