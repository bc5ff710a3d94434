"""What ``serve --deterministic`` costs: tok/s of ``auto`` and ``ar`` on the default runner and on
the fixed-row runner with chain drafts, interleaved prompt by prompt after a warm-up (one
Spec-Bench development prompt per category, 96 new tokens).

    python benchmarks/deterministic_speed.py bfloat16
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import speculum
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def main(dtype: str = "bfloat16", rows: int = 16, new_tokens: int = 96) -> None:
    model, tok = speculum.load("default", dtype=dtype)
    base = runner_for(model)
    fixed = base.with_fixed_rows(rows)
    first_of_category: dict[str, str] = {}
    for q in load_prompts(SPEC_BENCH):
        first_of_category.setdefault(q.category, q.text)
    prompts = [encode_prompt(tok, t, None) for t in list(first_of_category.values())[:6]]
    chains = {"max_tree": rows - 1, "chains_only": True}
    methods = {"auto default": build_method("auto", model, tok, runner=base),
               "auto fixed": build_method("auto", model, tok, runner=fixed, **chains),
               "ar default": build_method("ar", model, tok, runner=base),
               "ar fixed": build_method("ar", model, tok, runner=fixed, **chains)}
    for m in methods.values():  # warm-up
        m.run(prompts[0], 16)
    rates: dict[str, list[float]] = {k: [] for k in methods}
    for p in prompts:  # interleaved: every method on a prompt before the next prompt
        for k, m in methods.items():
            rates[k].append(m.run(p, new_tokens).tok_s)
    for k, v in rates.items():
        print(f"{dtype} {k:13s} mean tok/s {statistics.mean(v):6.1f}  per prompt {[round(x, 1) for x in v]}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
