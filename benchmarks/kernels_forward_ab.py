"""The native runner's forward of n rows on GGUF weights, with the quantized-weight kernels
(``kernels.cpp``, ``layer_ops.cpp``) of an older commit against the working tree's, interleaved in one
process (the decoder's compiled ops swapped between calls), after a context of ``--context`` tokens
(default 64). Both builds must
give the same logits (checked), so only the time differs.

    .venv/bin/python benchmarks/kernels_forward_ab.py OLD_REV [--threads 2] [--repeats 25] [--context 64]

Prints the median milliseconds per forward of each side and old / new, per row count.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
SOURCES = ("kernels.cpp", "layer_ops.cpp")


def old_sources(rev: str, where: Path) -> list[Path]:
    """The kernels' sources at commit ``rev``, written under ``where``."""
    paths = []
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:src/speculum/weights/{name}"], check=True,
                              capture_output=True, text=True).stdout
        (where / name).write_text(text)
        paths.append(where / name)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_rev")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--context", type=int, default=64, help="cached tokens before the timed forwards")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import speculum
    from speculum.extensions import build_extension
    from speculum.runners import runner_for
    from speculum.tree import DraftTree
    from speculum.weights.build import SOURCES as NEW_SOURCES

    with tempfile.TemporaryDirectory() as tmp:
        old = build_extension("speculum_qkernels_old", old_sources(args.old_rev, Path(tmp)))
    new = build_extension("speculum_qkernels_new", list(NEW_SOURCES))
    model, _ = speculum.load("default", weights="gguf")
    runner = runner_for(model, "native")
    dec = runner.decoder
    print(f"kernels: {new.isa()}; threads {args.threads}; context {args.context}; old = {args.old_rev}, "
          "new = the working tree\n")
    print("| rows | old ms | new ms | old / new |\n|---:|---:|---:|---:|")
    for n in ROWS:
        cache = runner.new_cache(args.context + 64)
        runner.prefill(cache, list(range(100, 100 + args.context)))
        tree = DraftTree.chain(list(range(200, 200 + n - 1)))
        times, logits = {"old": [], "new": []}, {}
        for _ in range(args.repeats):
            for side, ops in (("old", old), ("new", new)):
                dec.ops = ops
                dec._compiled.clear()  # (its layers hold the ops they were built with)
                logits[side] = runner.forward(cache, 5, tree).logits  # (a warm-up of this side)
                cache.pending = 0
                t = time.perf_counter()
                runner.forward(cache, 5, tree)
                times[side].append(time.perf_counter() - t)
                cache.pending = 0
        if not torch.equal(logits["old"], logits["new"]):
            raise SystemExit(f"{n} rows: the two builds' logits differ")
        o, w = (statistics.median(times[s]) * 1e3 for s in ("old", "new"))
        print(f"| {n} | {o:.2f} | {w:.2f} | {o / w:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
