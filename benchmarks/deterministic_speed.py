"""What the reproducible mode costs: tok/s of ``auto`` and ``ar`` on the default runner, on the
invariant runner with chain drafts (``serve --deterministic``, ``NativeRunner.invariant``) and on the
older fixed-row runner (every step padded to 16 rows, chain drafts), interleaved prompt by prompt
after a warm-up (one Spec-Bench development prompt per category, 96 new tokens). Each round
passes over the six prompts again; rates are all tokens over all time, per round.

    python benchmarks/deterministic_speed.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import speculum
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=16, help="the fixed-row runner's row count")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the six prompts")
    ap.add_argument("--methods", default="auto,ar")
    args = ap.parse_args()
    model, tok = speculum.load("default", dtype=args.dtype)
    base = runner_for(model)
    runners = {"default": (base, {}), "invariant": (base.invariant(), {"chains_only": True}),
               "fixed": (base.with_fixed_rows(args.rows), {"max_tree": args.rows - 1, "chains_only": True})}
    first_of_category: dict[str, str] = {}
    for q in load_prompts(SPEC_BENCH):
        first_of_category.setdefault(q.category, q.text)
    prompts = [encode_prompt(tok, t, None) for t in list(first_of_category.values())[:6]]
    methods = {f"{name} {mode}": build_method(name, model, tok, runner=runner, **opts)
               for name in args.methods.split(",") for mode, (runner, opts) in runners.items()}
    for m in methods.values():  # warm-up
        m.run(prompts[0], 16)
    tokens = {k: [0] * args.rounds for k in methods}  # per round
    seconds = {k: [0.0] * args.rounds for k in methods}
    for r in range(args.rounds):  # from round 2 on, the suffix cache and the bandit know the prompts
        for p in prompts:  # interleaved: every method on a prompt before the next prompt
            for k, m in methods.items():
                out = m.run(p, args.new_tokens)
                tokens[k][r] += len(out.tokens)
                seconds[k][r] += out.time_s
    for k in methods:
        base_k = k.split()[0] + " default"
        cells = [f"round {r + 1}: {tokens[k][r] / seconds[k][r]:6.1f} tok/s "
                 f"({tokens[k][r] / seconds[k][r] / (tokens[base_k][r] / seconds[base_k][r]):.2f}x default)"
                 for r in range(args.rounds)]
        print(f"{args.dtype} {k:20s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
