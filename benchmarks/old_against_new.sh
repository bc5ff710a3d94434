#!/usr/bin/env bash
# Speed of an older commit against the working tree, alternating: old, new, old, new, ... (RUNS pairs),
# each a `speculum bench` run of METHODS on the Spec-Bench dev prompts in its own process (one
# loaded model, every method warmed up first). Writes OUT/{old,new}-N/ and prints tok/s per method.
#
#   benchmarks/old_against_new.sh OLD_REV ar,ngram,mix,auto OUT [RUNS] [-- more bench options]
set -euo pipefail
old_rev=$1 methods=$2 out=$3 runs=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
tree=$(mktemp -d)/old
git -C "$here" worktree add -f --detach "$tree" "$old_rev" >/dev/null
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
data=${DATA:-$here/../shared/data/spec_bench/question_dev.jsonl}
mkdir -p "$out"
for i in $(seq 1 "$runs"); do
  for side in old new; do
    src=$here/src
    [ "$side" = old ] && src=$tree/src
    PYTHONPATH=$src "$py" -m speculum.cli bench --data "$data" --per-task 3 --max-new-tokens 128 \
      --methods "$methods" --out "$out/$side-$i" --no-progress "$@" > "$out/$side-$i.log" 2>&1
  done
done
"$py" - "$out" "$runs" <<'EOF'
import json, sys
from pathlib import Path
out, runs = Path(sys.argv[1]), int(sys.argv[2])
def rates(d):
    methods = json.loads((Path(d) / "results.json").read_text())["methods"]
    return {m: r["overall"]["tok_s"] for m, r in methods.items()}
for i in range(1, runs + 1):
    old, new = rates(out / f"old-{i}"), rates(out / f"new-{i}")
    print(f"run {i}: " + ", ".join(f"{m} {old[m]:.1f} -> {new[m]:.1f} ({new[m] / old[m]:.3f}x)" for m in old))
EOF
