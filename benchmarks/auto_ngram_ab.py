"""``auto`` with its ngram arm's chains scored and sized (the default) against ``auto`` with the unscored
chains it drafted before, and ``ar``, interleaved per prompt in one process (the order rotating), on the
first ``PER_TASK`` Spec-Bench development prompts of each task, 128 new tokens, greedy (outputs checked equal).

    PYTHONPATH=src python benchmarks/auto_ngram_ab.py 6

Prints each method's speed over ``ar``'s per task and overall.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import speculum
from speculum.bench.data import load_prompts
from speculum.drafters.ngram import NgramDrafter
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for
from speculum.sampling import SamplingParams

DATA = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question_dev.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("per_task", type=int)
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args()
    model, tok = speculum.load("default", weights="gguf")
    runner = runner_for(model)
    methods = {name: build_method("ar" if name == "ar" else "auto", model, tok, runner=runner)
               for name in ("ar", "auto", "auto_unscored_ngram")}
    old = methods["auto_unscored_ngram"].engine.drafter
    old.ngram = old.arms["ngram"] = NgramDrafter()
    prompts = load_prompts(args.data, args.per_task)
    sampling = SamplingParams()
    for m in methods.values():  # warm-up
        m.run(encode_prompt(tok, "Write a haiku about the sea."), 16, sampling, seed=0)
    seconds, tokens = collections.defaultdict(float), collections.defaultdict(int)
    names = list(methods)
    for i, p in enumerate(prompts):
        ids = encode_prompt(tok, p.text)
        outputs = {}
        for name in names[i % 3:] + names[:i % 3]:
            r = methods[name].run(ids, 128, sampling, seed=i)
            seconds[name, p.task] += r.time_s
            tokens[name, p.task] += r.new_tokens
            outputs[name] = r.tokens
        if not outputs["ar"] == outputs["auto"] == outputs["auto_unscored_ngram"]:
            raise SystemExit(f"outputs differ on {p.question_id}")
    tasks = sorted({p.task for p in prompts})

    def rate(name, ts):
        return sum(tokens[name, t] for t in ts) / sum(seconds[name, t] for t in ts)

    print("| method | " + " | ".join(tasks) + " | overall |\n|---|" + "---:|" * (len(tasks) + 1))
    for name in names:
        cells = [f"{rate(name, [t]) / rate('ar', [t]):.2f}x" for t in tasks]
        print(f"| {name} ({rate(name, tasks):.1f} tok/s) | " + " | ".join(cells)
              + f" | {rate(name, tasks) / rate('ar', tasks):.2f}x |")


if __name__ == "__main__":
    main()
