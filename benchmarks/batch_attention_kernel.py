"""Which attention kernel runs batched decoding steps faster over long contexts on this CPU: one
step of ``ar`` (one new token for each of ``B`` sequences of ``L`` cached tokens in a slot pool)
with the explicit math path against SDPA's flash kernel, interleaved, median of 8. The batched
counterpart of ``decode_attention_kernel.py``.

    .venv/bin/python benchmarks/batch_attention_kernel.py [--threads 1] [--shapes 4x1024,4x2048,...]
"""

import argparse

import torch
from decode_attention_kernel import kernel_medians  # this folder's script (run from here)

from speculum import load
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine, step
from speculum.runners import runner_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x512,4x1024,8x1024,4x2048,8x2048,4x4096",
                    help="BxL: sequences x cached tokens each, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (a serving engine runs one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load("default", "bfloat16")
    runner = runner_for(model)
    engine = Engine(runner, AutoregressiveDrafter(), tok)
    print(f"{args.threads} kernel threads, torch {torch.__version__}")
    print("| B x L | math ms | SDPA ms | SDPA / math |\n|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split("x"))
        pool = runner.new_pool(b, length + 64)
        decodings = [engine.start([100 + (i * 7 + j) % 5000 for j in range(length)], 40, cache=pool.acquire(),
                                  drafter=engine.drafter.fork()) for i in range(b)]
        m, s = kernel_medians(lambda batch=decodings: step(batch), 9)
        print(f"| {b} x {length} | {m:.1f} | {s:.1f} | {s / m:.2f} |", flush=True)
        del pool, decodings


if __name__ == "__main__":
    main()
