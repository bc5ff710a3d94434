"""Judge decoding's quality cost on SmolLM2 (LOSSY rule): train a proxy-label judge, then compare
greedy output with and without it against ``ar``'s (exact-match rate, token accuracy, tokens/step).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/judge_quality.py [--method eagle] [--train 8]
"""

from __future__ import annotations

import argparse
import json
import time

import speculum
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for
from speculum.train.judge import train_judge
from speculum.train.prompts import training_prompts


def agreement(ref: list[int], out: list[int]) -> tuple[bool, float, int]:
    """(exact match, positional token accuracy over ref's length, index of the first difference)."""
    same = sum(a == b for a, b in zip(ref, out)) / max(len(ref), 1)
    first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    return ref == out, same, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--train", type=int, default=8, help="training prompts")
    ap.add_argument("--train-tokens", type=int, default=48)
    ap.add_argument("--dev", type=int, default=4, help="dev prompts (other seed)")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--thresholds", default="0.5,0.9")
    args = ap.parse_args()
    model, tok = speculum.load("default")
    runner = runner_for(model)
    t = time.perf_counter()
    train = [encode_prompt(tok, text) for _, text in training_prompts(args.train, seed=0)]
    head = train_judge(runner, train, args.train_tokens, args.ratio)
    print(f"trained judge on {len(train)} x {args.train_tokens} tokens in {time.perf_counter() - t:.0f}s")
    dev = [encode_prompt(tok, text) for _, text in training_prompts(args.dev, seed=1)]
    ar = build_method("ar", model, tok, runner=runner)
    refs = [ar.run(p, args.new).tokens for p in dev]
    rows = {}
    configs = [("exact", None)] + [(f"judge@{th}", float(th)) for th in args.thresholds.split(",")]
    for label, th in configs:
        opts = {} if th is None else {"judge": head, "judge_threshold": th}
        m = build_method(args.method, model, tok, runner=runner, sized=False, **opts)
        outs = [m.run(p, args.new) for p in dev]
        stats = [agreement(r, o.tokens) for r, o in zip(refs, outs)]
        rows[label] = {"exact_match": sum(s[0] for s in stats) / len(stats),
                       "token_accuracy": round(sum(s[1] for s in stats) / len(stats), 3),
                       "first_diff": [s[2] for s in stats],
                       "tokens_per_step": round(sum(o.new_tokens for o in outs) / sum(o.forwards for o in outs), 3)}
        print(label, json.dumps(rows[label]), flush=True)


if __name__ == "__main__":
    main()
