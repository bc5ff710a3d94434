#!/bin/bash
# old (ba76605) and new (main) alternately, same command, this AVX2 machine
set -e
CMD="bench --data /work/shared/data/spec_bench/question_dev.jsonl --per-task 2 --max-new-tokens 128 --methods ar,mix,auto,llama_cpp --no-progress"
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/old; else dir=/work/main; fi
    cd $dir && PYTHONPATH=$dir/src /work/main/.venv/bin/python -m speculum $CMD --out /tmp/ab/$side-$round > /tmp/ab/$side-$round.log 2>&1
    echo "$side $round done $(date +%T)"
  done
done
