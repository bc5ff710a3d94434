"""How speculation follows the batch size (SmartSpec's goodput rule in ``TreeSizer.select_batch``).

Decodes the first ``--requests`` Spec-Bench development prompts with ``auto`` in batches of
``B`` requests for each ``B`` in ``--batches`` (in-process, no server), and reports per ``B``:
drafted nodes per request per step, tokens committed per request per step, and total generated
tokens per second. The same prompts at every ``B``, each ``B`` with a fresh method (no drafter
state learnt from these prompts), after a warm-up batch on other prompts.

    python benchmarks/batch_speculation.py --dtype bfloat16 --batches 1,4,8,16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import speculum
from speculum.batching import Batcher, BatchRequest
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question_dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", type=Path, default=SPEC_BENCH)
    args = ap.parse_args()

    model, tok = speculum.load("default", dtype=args.dtype)
    runner = runner_for(model).invariant()  # as `serve` runs it by default where the floors are cheap
    chosen = load_prompts(args.data, per_task=6)
    prompts = [encode_prompt(tok, p.text) for p in chosen][: args.requests]
    used = {p.question_id for p in chosen[: args.requests]}
    warm = [encode_prompt(tok, p.text) for p in load_prompts(args.data) if p.question_id not in used]
    print(f"{args.method}, {args.dtype}, {len(prompts)} prompts, {args.max_new_tokens} new tokens each")
    print("| batch | drafted nodes / request / step | tokens / request / step | total tok/s |")
    print("|---:|---:|---:|---:|")
    for b in [int(x) for x in args.batches.split(",")]:
        # a fresh method per batch size: drafters that learn across requests must not have seen
        # these prompts' answers at a previous size; the warm-up uses prompts outside the set
        method = build_method(args.method, model, tok, runner=runner, chains_only=True)
        batcher = Batcher(runner, max_batch=b)
        batcher.run([BatchRequest(method.engine, p, 16) for p in warm[:b]])
        t0 = time.perf_counter()
        results = batcher.run([BatchRequest(method.engine, p, args.max_new_tokens) for p in prompts])
        wall = time.perf_counter() - t0
        steps = [s for r in results for s in r.steps]
        drafted = sum(s.drafted for s in steps) / len(steps)
        committed = sum(s.committed for s in steps) / len(steps)
        tokens = sum(r.new_tokens for r in results)
        print(f"| {b} | {drafted:.2f} | {committed:.2f} | {tokens / wall:.1f} |")


if __name__ == "__main__":
    main()
