"""Matrix products of the default model's shapes at 1-32 rows: speculum's quantized kernels against
float (oneDNN-prepacked float32 and bfloat16, as the native runner runs float weights), torch's
weight-only int8/int4 CPU kernels and llama.cpp's own product (ggml's ``mul_mat`` on the same GGML
type, :mod:`ggml_products`); and whole forwards of n rows against llama.cpp's (llama-cpp-python
decoding an n-token batch on the same GGUF). The llama.cpp columns need llama-cpp-python (``make llama``).

    .venv/bin/python benchmarks/gguf_kernels.py [--threads 2] [--out bench-out/gguf-kernels.md]

Times are medians of interleaved repeats after a warm-up, in milliseconds per call.
"""

# ruff: noqa: B023  (the timed closures run within the iteration that defines them)
from __future__ import annotations

import argparse
import statistics
import time

import torch

ROWS = (1, 2, 4, 8, 16, 32)


def median_ms(fns: dict, repeats: int) -> dict:
    """Each callable's median time over ``repeats`` rounds, the callables interleaved within a round."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _ggml_product(threads: int):
    """``(rows_out, cols_in, qtype, n) -> callable`` timing llama.cpp's product once, or None without
    llama-cpp-python."""
    try:
        import ggml_products
        ggml_products.lib()
    except (ImportError, OSError):
        return None

    def make(rows_out: int, cols_in: int, qtype: str, n: int):
        graph = ggml_products._graph(rows_out, cols_in, qtype, n, True)[0]
        return lambda: ggml_products._compute(graph, threads)

    return make


def product_table(model, repeats: int, threads: int) -> list[str]:
    from speculum.drafting.quantized_copy import QuantLinear, linear_weight
    from speculum.runners import runner_for
    from speculum.runners.packed import packed_linear

    dec = runner_for(model, "native").decoder
    layer = dec.layers[0]
    shapes = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": dec.head}
    ggml = _ggml_product(threads)
    lines = [("| product (out x in, format) | rows | float32 | bfloat16 | torch int8 | torch int4 | llama.cpp | "
              "speculum |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, lin in shapes.items():
        w = linear_weight(lin)  # [out, in] float32, the quantized values
        f32, bf16 = packed_linear(w), packed_linear(w.bfloat16())
        q8, q4 = QuantLinear(w, None, 8), QuantLinear(w, None, 4)
        for n in ROWS:
            x = torch.randn(n, w.shape[1])
            xb = x.bfloat16()
            fns = {"f32": (lambda: f32(x)) if f32 else (lambda: torch.nn.functional.linear(x, w)),
                   "bf16": (lambda: bf16(xb)) if bf16 else (lambda: torch.nn.functional.linear(xb, w.bfloat16())),
                   "int8": lambda: q8(x), "int4": lambda: q4(x), "ours": lambda: lin(x)}
            fmt = getattr(getattr(lin, "weight", None), "source", "?")
            if ggml is not None and "+" not in fmt:  # (a fused matrix of one format: llama.cpp runs its parts)
                fns["llama"] = ggml(w.shape[0], w.shape[1], fmt, n)
            t = median_ms(fns, repeats)
            lines.append(f"| {name} ({w.shape[0]} x {w.shape[1]}, {fmt}) | {n} | {t['f32']:.3f} | {t['bf16']:.3f} | "
                         f"{t['int8']:.3f} | {t['int4']:.3f} | {t.get('llama', float('nan')):.3f} | {t['ours']:.3f} |")
    return lines


def forward_table(model, path: str, threads: int, repeats: int) -> list[str]:
    """A whole forward of n new rows after a 64-token context: speculum's native runner against
    llama.cpp's ``llama_decode`` of an n-token batch (its logits for every row)."""
    from speculum.runners import runner_for
    from speculum.tree import DraftTree

    runner = runner_for(model, "native")
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=512, logits_all=True,
                              verbose=False)
    context = list(range(100, 164))
    lines = ["| rows | speculum forward (ms) | llama.cpp decode (ms) |", "|---:|---:|---:|"]
    for n in ROWS:
        cache = runner.new_cache(256)
        runner.prefill(cache, context)

        def ours():
            runner.forward(cache, 5, DraftTree.chain(list(range(200, 200 + n - 1))))
            cache.pending = 0

        fns = {"ours": ours}
        if llm is not None:
            llm.reset()
            llm.eval(context)

            def theirs():
                llm.n_tokens = len(context)
                llm.eval(list(range(200, 200 + n)))

            fns["llama"] = theirs
        t = median_ms(fns, repeats)
        lines.append(f"| {n} | {t['ours']:.2f} | {t.get('llama', float('nan')):.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import speculum
    from speculum.models import resolve
    from speculum.weights.build import cpu_flags, kernels

    model, _ = speculum.load("default", weights="gguf")
    lines = [f"CPU flags: {' '.join(cpu_flags())}; kernels: {kernels().isa()}; threads: {args.threads}", ""]
    lines += product_table(model, args.repeats, args.threads) + [""]
    lines += forward_table(model, resolve("default")[1], args.threads, args.repeats)
    text = "\n".join(lines)
    print(text)
    if args.out:
        import os

        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
