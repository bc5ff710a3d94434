"""Does the same temperature-0 request give one output when other requests run in between?

For each of the first ``--prompts`` Spec-Bench development prompts, each method answers it
``--repeats`` times, another prompt in between each time (so the suffix cache, the recycling
table and ``auto``'s bandit change), and the script counts the distinct outputs and whether they
equal ``ar``'s. ``--mode default`` is the usual runner; ``--mode invariant`` the reproducible one
(``serve``'s default where the kernels allow it: row-invariant steps, chain drafts only);
``--mode fixed`` the fallback (every step padded to ``--rows`` rows, chain drafts only).

    python benchmarks/reproducibility.py --dtype bfloat16 --mode invariant
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import speculum
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", choices=["default", "fixed", "invariant"], default="invariant")
    ap.add_argument("--rows", type=int, default=16, help="--mode fixed: the padded row count")
    ap.add_argument("--methods", default="ar,auto,suffix,recycling")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--data", type=Path, default=SPEC_BENCH)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = speculum.load("default", dtype=args.dtype)
    runner = runner_for(model)
    fixed = args.mode != "default"
    if args.mode == "fixed":
        runner = runner.with_fixed_rows(args.rows)
    elif args.mode == "invariant":
        runner = runner.invariant()
    ids = [encode_prompt(tok, q.text, None) for q in load_prompts(args.data)]
    for p, target in enumerate(ids[:args.prompts]):
        outputs: dict[str, collections.Counter] = {}
        for name in args.methods.split(","):
            opts = {"chains_only": True} if fixed else {}
            if args.mode == "fixed":
                opts["max_tree"] = args.rows - 1
            method = build_method(name, model, tok, runner=runner, **opts)
            seen: collections.Counter = collections.Counter()
            for rep in range(args.repeats if name != "ar" else 1):
                seen[tuple(method.run(target, args.max_new_tokens).tokens)] += 1
                method.run(ids[(7 * rep + 3) % len(ids)], 48)  # another request in between
            outputs[name] = seen
            same = "ar" in outputs and set(seen) == set(outputs["ar"])
            print(f"prompt {p} {args.dtype} {args.mode:7s} {name:10s} distinct outputs: {len(seen)} "
                  f"{sorted(seen.values(), reverse=True)}  all equal to ar's: {same}", flush=True)


if __name__ == "__main__":
    main()
