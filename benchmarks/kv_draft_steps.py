"""Where the time of lossless long-context drafting goes: one RULER niah_single prompt of ~8k
tokens, plain `ar` against `kv_draft` views, per step (tokens committed, draft and verify time).

    .venv/bin/python benchmarks/kv_draft_steps.py [--reproducible] [--length 8064] [--new 48]
"""

import argparse

import torch

from speculum import load
from speculum.bench.longctx import encode_task
from speculum.bench.ruler import make_task
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.kv_draft import KVDraftDrafter
from speculum.engine import Engine
from speculum.runners import runner_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reproducible", action="store_true", help="the reproducible runner, chains verified")
    ap.add_argument("--length", type=int, default=8064)
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    model, tok = load("default", "bfloat16")
    runner = runner_for(model)
    runner = runner.invariant() if args.reproducible else runner
    task = make_task("niah_single", args.length, 0, lambda t: len(tok(t, add_special_tokens=False)["input_ids"]),
                     ("number",))
    ids, _ = encode_task(tok, task, None)
    print(f"prompt: {len(ids)} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| run | tok/s | tokens per step | draft ms/step | verify ms/step |\n|---|---:|---:|---:|---:|")
    for name, drafter in [("ar", AutoregressiveDrafter()), ("kv_draft int4, window 512", KVDraftDrafter(model)),
                          ("kv_draft int4, window 256", KVDraftDrafter(model, window=256)),
                          ("kv_draft int4, snapkv (window 256 + 512 picked)", KVDraftDrafter(model, policy="snapkv")),
                          ("kv_draft int4, quest (window 256 + 32 pages of 16 per forward)",
                           KVDraftDrafter(model, policy="quest"))]:
        engine = Engine(runner, drafter, tok, chains_only=args.reproducible)
        engine.generate(ids[-300:], 4)  # warm-up
        r = engine.generate(ids, args.new)
        n = len(r.steps)
        print(f"| {name} | {r.new_tokens / (r.time_s - r.prefill_s):.1f} | {r.new_tokens / n:.2f} | "
              f"{1e3 * sum(s.draft_s for s in r.steps) / n:.1f} | {1e3 * sum(s.verify_s for s in r.steps) / n:.1f} |")


if __name__ == "__main__":
    main()
