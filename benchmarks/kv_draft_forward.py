"""The cost of one draft forward of `kv_draft` over its view, after a RULER niah_single prompt of
~8k tokens: the median over repeats of a 4-row chain's forwards (one row each), bfloat16.

    .venv/bin/python benchmarks/kv_draft_forward.py [--policy snapkv] [--bits 4] [--repeats 20] [--profile]

Run it on two checkouts (``PYTHONPATH=OTHER/src``) to compare a change to the draft's forward.
"""

import argparse
import time

import torch

from speculum import load
from speculum.bench.longctx import encode_task
from speculum.bench.ruler import make_task
from speculum.drafters.kv_draft import KVDraftDrafter
from speculum.engine import Engine
from speculum.runners import runner_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--length", type=int, default=8064)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also print torch's profile of ten chains")
    args = ap.parse_args()
    model, tok = load("default", "bfloat16")
    task = make_task("niah_single", args.length, 0, lambda t: len(tok(t, add_special_tokens=False)["input_ids"]),
                     ("number",))
    ids, _ = encode_task(tok, task, None)
    drafter = KVDraftDrafter(model, policy=args.policy, bits=args.bits)
    engine = Engine(runner_for(model), drafter, tok)
    engine.generate(ids[-300:], 4)  # warm-up
    engine.generate(ids, 16)  # the prompt in the cache, the view built, a few tokens committed
    draft, cache = drafter.model, drafter.target_cache

    def chain(rows: int = 4) -> None:
        draft.begin(cache, rows)
        at = cache.length
        for r in range(rows):
            draft.run(torch.tensor([5 + r]), torch.tensor([at + r]), torch.ones(1, r + 1, dtype=torch.bool))

    with torch.inference_mode():
        for _ in range(5):
            chain()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            chain()
            times.append((time.perf_counter() - t) / 4)
        times.sort()
        print(f"{args.policy} view, {args.bits}-bit draft, {cache.length} committed tokens, "
              f"{torch.get_num_threads()} threads: one draft forward {1e3 * times[len(times) // 2]:.2f} ms "
              f"(median of {args.repeats}; fastest {1e3 * times[0]:.2f})")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    chain()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
