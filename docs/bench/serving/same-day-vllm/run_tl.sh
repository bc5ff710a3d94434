#!/bin/bash
# usage (from the repository root): run_tl.sh SRC C OUT [serve args]: a fresh `speculum serve` from
# SRC's code, C clients x 48 requests with per-request timestamps and the processes' CPU (timeline.py)
SRC=$1; C=$2; OUT=$3; shift 3
HERE=$(dirname "$0")
PYTHONPATH=$SRC .venv/bin/python -m speculum serve --port 8711 "$@" > $OUT.serve.log 2>&1 &
SP=$!
for i in $(seq 150); do curl -s localhost:8711/v1/models >/dev/null && break; sleep 2; done
sleep 3
PIDS=$(echo $SP $(pgrep -P $SP | grep -v "$(pgrep -f resource_tracker)") | tr ' ' ',')
.venv/bin/python $HERE/timeline.py http://127.0.0.1:8711/v1 $C 48 $OUT.json $PIDS
kill $SP; wait $SP 2>/dev/null
.venv/bin/python $HERE/analyze.py $OUT.json $C
