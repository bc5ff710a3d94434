"""What ``serve --deterministic`` costs: tok/s of ``auto`` and ``ar`` on the default runner and on
the fixed-row runner with chain drafts, interleaved prompt by prompt after a warm-up (one
Spec-Bench development prompt per category, 96 new tokens).

    python benchmarks/deterministic_speed.py bfloat16
"""

import json
import statistics
import sys

import speculum
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
model, tok = speculum.load("default", dtype=dtype)
base = runner_for(model)
fixed = base.with_fixed_rows(16)
qs = [json.loads(l) for l in open("../shared/data/spec_bench/question_dev.jsonl")]
by_cat = {}
for q in qs:
    by_cat.setdefault(q["category"], q["turns"][0])
prompts = [encode_prompt(tok, t, None) for t in list(by_cat.values())[:6]]
methods = {"auto default": build_method("auto", model, tok, runner=base),
           "auto fixed": build_method("auto", model, tok, runner=fixed, max_tree=15, chains_only=True),
           "ar default": build_method("ar", model, tok, runner=base),
           "ar fixed": build_method("ar", model, tok, runner=fixed, max_tree=15, chains_only=True)}
for m in methods.values():
    m.run(prompts[0], 16)
rates = {k: [] for k in methods}
for p in prompts:
    for k, m in methods.items():
        r = m.run(p, 96)
        rates[k].append(r.new_tokens / r.time_s)
for k, v in rates.items():
    print(f"{dtype} {k:13s} mean tok/s {statistics.mean(v):6.1f}  per prompt {[round(x, 1) for x in v]}", flush=True)
