#!/bin/bash
# usage: serve_run.sh SRC C OUT [bench args]: a fresh server from SRC's code, one concurrency level
SRC=$1; C=$2; OUT=$3; shift 3
cd /work/main
PYTHONPATH=$SRC .venv/bin/python -m speculum serve --port 8711 > $OUT.serve.log 2>&1 &
SP=$!
for i in $(seq 150); do curl -s localhost:8711/v1/models >/dev/null && break; sleep 2; done
sleep 3
.venv/bin/speculum bench --workload serving --url http://127.0.0.1:8711/v1 --model default --concurrency $C --requests 48 --max-tokens 64 --data ../shared/data/spec_bench/question_dev.jsonl --out $OUT.bench --no-progress --system-tokens 0 "$@" > $OUT.bench.log 2>&1
kill $SP; wait $SP 2>/dev/null
sleep 2
grep -A6 "tok/s" $OUT.bench/results.md | head -8
