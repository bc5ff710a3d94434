"""Which attention kernel decodes faster over a long context on this CPU: one decoding forward
(``rows`` new tokens, default 1) after ``L`` cached tokens, with the explicit math path against
SDPA's flash kernel, interleaved, median of 7 (the entries are rolled back after each forward).
Sets :data:`speculum.attention.MATH_ATTENTION_KEYS_PER_THREAD`.

    .venv/bin/python benchmarks/decode_attention_kernel.py [--threads 2] [--contexts 512,1024,...]
"""

import argparse
import time

import torch

from speculum import attention, load
from speculum.runners import runner_for
from speculum.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,1024,1536,2048,3072,4096,8000")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    model, _ = load("default", "bfloat16")
    runner = runner_for(model)
    cache = runner.new_cache(max(contexts) + 100)
    runner.prefill(cache, [100 + i % 5000 for i in range(max(contexts))])
    tree = DraftTree.chain(list(range(200, 199 + args.rows)))
    print(f"{args.threads} kernel threads, {args.rows} row(s), torch {torch.__version__}")
    print("| cached tokens (longest first) | math ms | SDPA ms | SDPA / math |\n|---:|---:|---:|---:|")
    kept = attention.MATH_ATTENTION_KEYS_PER_THREAD
    try:
        for length in sorted(contexts, reverse=True):  # a cache rolls back, never forward
            times: dict[str, list[float]] = {"math": [], "sdpa": []}
            for rep in range(8):
                for kernel in ("math", "sdpa"):
                    attention.MATH_ATTENTION_KEYS_PER_THREAD = 0 if kernel == "math" else 1 << 40
                    cache.rollback(length)
                    t = time.perf_counter()
                    runner.forward(cache, 5, tree)
                    if rep:  # the first round warms up
                        times[kernel].append(time.perf_counter() - t)
                    cache.commit([0])
            m, s = (1e3 * sorted(times[k])[3] for k in ("math", "sdpa"))
            print(f"| {length} | {m:.1f} | {s:.1f} | {s / m:.2f} |", flush=True)
    finally:
        attention.MATH_ATTENTION_KEYS_PER_THREAD = kept


if __name__ == "__main__":
    main()
