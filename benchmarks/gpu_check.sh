#!/usr/bin/env bash
# Issue 44's GPU measurements in one run (benchmarks/gpu_check.py writes OUT/gpu_check.md), from this
# source tree, on a machine with torch (CUDA) and transformers; speculum need not be installed.
#
#   benchmarks/gpu_check.sh GGUF DATA [OUT]
#
# GGUF: SmolLM2-135M-Instruct.Q4_1.gguf (the default model's file; its name finds the shipped heads).
# DATA: Spec-Bench's question_dev.jsonl. OUT: the output directory (default gpu-check).
# Reading a GGUF file needs the `gguf` package; where it is missing, a wheel of it in $WHEELS
# (default: .whl beside src/, e.g. `pip download --no-deps gguf -d .whl` on a machine with the
# package index) is installed into a temporary directory. Takes about 8 minutes on an H100.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gguf=${1:?usage: benchmarks/gpu_check.sh GGUF DATA [OUT]}
data=${2:?usage: benchmarks/gpu_check.sh GGUF DATA [OUT]}
out=${3:-gpu-check}
py=${PYTHON:-python3}
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! "$py" -c "import gguf" 2>/dev/null; then
    wheels=${WHEELS:-$root/.whl}
    if ! ls "$wheels"/gguf-*.whl >/dev/null 2>&1; then
        echo "gpu_check: the gguf package is missing and no gguf wheel is in $wheels (set WHEELS)" >&2
        exit 2
    fi
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/gguf-*.whl
    export PYTHONPATH="$site:$PYTHONPATH"
fi
exec "$py" "$root/benchmarks/gpu_check.py" --gguf "$gguf" --data "$data" --out "$out" "${@:4}"
