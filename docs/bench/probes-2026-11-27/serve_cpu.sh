#!/bin/bash
# usage: serve_cpu.sh CONC OUTDIR [serve args...]
C=$1; OUT=$2; shift 2
cd /work/main
.venv/bin/speculum serve --port 8711 "$@" > $OUT.serve.log 2>&1 &
SP=$!
for i in $(seq 120); do curl -s localhost:8711/v1/models >/dev/null && break; sleep 2; done
sleep 3
snap() { for p in $(pgrep -f "speculum serve" ; pgrep -P $SP); do echo "$p $(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null) $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-80)"; done | sort -u; }
snap > $OUT.cpu0
/usr/bin/time -v .venv/bin/speculum bench --workload serving --url http://127.0.0.1:8711/v1 --model default --concurrency $C --requests 48 --max-tokens 64 --data ../shared/data/spec_bench/question_dev.jsonl --out $OUT.bench --no-progress --system-tokens 0 > $OUT.bench.log 2>&1
snap > $OUT.cpu1
kill $SP; wait $SP 2>/dev/null
