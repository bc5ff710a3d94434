"""Does a temperature-0 request give the same output whatever else shares its batch?

For each of the first ``--prompts`` Spec-Bench development prompts, the script decodes it alone
(a batch of one), then ``--repeats`` times inside a batch of ``--batch`` requests whose other
members are other prompts, drawn anew each time (so the batch's size, the slots, the other
sequences' lengths and trees all change), and counts the distinct outputs and how many equal the
solo one. ``--mode invariant`` is ``serve``'s reproducible runner (row floors, explicit attention,
chain drafts); ``--mode default`` the usual runner with whole trees.

    python benchmarks/batch_reproducibility.py --dtype bfloat16 --mode invariant
"""

from __future__ import annotations

import argparse
import random
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
    ap.add_argument("--mode", choices=["default", "invariant"], default="invariant")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", type=Path, default=SPEC_BENCH)
    args = ap.parse_args()

    model, tok = speculum.load("default", dtype=args.dtype)
    runner = runner_for(model)
    if args.mode == "invariant":
        runner = runner.invariant()
    method = build_method(args.method, model, tok, runner=runner, chains_only=args.mode == "invariant")
    texts = [p.text for p in load_prompts(args.data)]
    ids = [encode_prompt(tok, t) for t in texts]
    rng = random.Random(0)
    batcher = Batcher(runner, max_batch=args.batch)
    print(f"mode {args.mode}, {args.dtype}, {args.method}, batches of {args.batch}")
    for i in range(args.prompts):
        solo = batcher.run([BatchRequest(method.engine, ids[i], args.max_new_tokens)])[0].tokens
        outs = []
        for _ in range(args.repeats):
            size = rng.randint(2, args.batch)
            others = rng.sample([j for j in range(len(ids)) if j != i], size - 1)
            members = others[: rng.randint(0, size - 1)] + [i]
            members += [j for j in others if j not in members]
            reqs = [BatchRequest(method.engine, ids[j], args.max_new_tokens) for j in members]
            outs.append(tuple(batcher.run(reqs)[members.index(i)].tokens))
        print(f"prompt {i}: {len(set(outs))} distinct outputs in {args.repeats} batched runs; "
              f"{sum(o == tuple(solo) for o in outs)} equal the solo output")


if __name__ == "__main__":
    main()
