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


def kernel_medians(run, rounds: int, reset=None) -> tuple[float, float]:
    """``run()`` under the math path and under SDPA for few rows (``MATH_ATTENTION_KEYS_PER_THREAD``
    set to 0 and to never), interleaved for ``rounds`` rounds, the first a warm-up, ``reset()`` (if
    given) after each run, untimed: the median ms of each, (math, SDPA)."""
    kept = attention.MATH_ATTENTION_KEYS_PER_THREAD
    times: dict[str, list[float]] = {"math": [], "sdpa": []}
    try:
        for rep in range(rounds):
            for kernel in ("math", "sdpa"):
                attention.MATH_ATTENTION_KEYS_PER_THREAD = 0 if kernel == "math" else 1 << 40
                t = time.perf_counter()
                run()
                if rep:
                    times[kernel].append(time.perf_counter() - t)
                if reset is not None:
                    reset()
    finally:
        attention.MATH_ATTENTION_KEYS_PER_THREAD = kept
    return tuple(1e3 * sorted(times[k])[len(times[k]) // 2] for k in ("math", "sdpa"))


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
    for length in sorted(contexts, reverse=True):  # a cache rolls back, never forward
        def reset(length: int = length) -> None:
            cache.commit([0])
            cache.rollback(length)

        cache.rollback(length)
        m, s = kernel_medians(lambda: runner.forward(cache, 5, tree), 8, reset)
        print(f"| {length} | {m:.1f} | {s:.1f} | {s / m:.2f} |", flush=True)


if __name__ == "__main__":
    main()
