"""A decoding forward over a long context in a nearly full KV buffer, its attention spanning the
whole contiguous buffer (:func:`speculum.attention.capacity_span`) against the same forward
with the span turned off (a slice of the buffer's keys and values copied in every layer):
same cache, interleaved, the median of the repetitions after a warm-up.

Usage::

    python benchmarks/attention_span.py [--model default] [--cached 8000] [--tokens 1,7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import speculum
from speculum.runners import decoder, runner_for
from speculum.tree import DraftTree
from speculum.verify import greedy_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cached", type=int, default=8000, help="cached tokens before the timed step")
    ap.add_argument("--tokens", default="1,7", help="tokens per timed forward (a chain), comma-separated")
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    model, _ = speculum.load(args.model, dtype=args.dtype)
    runner = runner_for(model)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.cached)]
    counts = [int(t) for t in args.tokens.split(",")]
    cache = runner.new_cache(args.cached + 200)
    runner.prefill(cache, prompt)
    spans = {"spanned": decoder.capacity_span, "slice copied": lambda *a: False}
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats + 2):  # the first two are warm-up
        for n in counts:
            tree = DraftTree.chain([rng.randrange(1000, 30000) for _ in range(n - 1)])
            for label, rule in spans.items():
                decoder.capacity_span = rule
                t0 = time.perf_counter()
                greedy_tokens(runner.forward_tree(cache, 5, tree))
                if rep >= 2:
                    times.setdefault((label, n), []).append(time.perf_counter() - t0)
                cache.pending = 0
    decoder.capacity_span = spans["spanned"]
    print(f"| tokens | {' | '.join(spans)} | ratio |\n|---:|---:|---:|---:|")
    for n in counts:
        spanned, copied = (statistics.median(times[label, n]) * 1e3 for label in spans)
        print(f"| {n} | {spanned:.1f} ms | {copied:.1f} ms | {copied / spanned:.2f} |")


if __name__ == "__main__":
    main()
