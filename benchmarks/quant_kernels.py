"""Time one-row products through SmolLM2-135M's linear shapes: bfloat16 (oneDNN-packed, the native
runner's) against the int8 and int4 weight-only kernels ``quant_self`` drafts with.

    .venv/bin/python benchmarks/quant_kernels.py
"""

import time

import torch

from speculum.drafting.quantized_copy import QuantLinear
from speculum.runners.packed import packed_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def per_call_ms(f, n: int = 300) -> float:
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    print("| product | bfloat16 ms | int8 ms | int4 ms |\n|---|---:|---:|---:|")
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.05
        x = torch.randn(1, in_f, dtype=torch.bfloat16)
        bf16 = packed_linear(w) or (lambda x, w=w: torch.nn.functional.linear(x, w))
        q8, q4 = QuantLinear(w, None, 8), QuantLinear(w, None, 4)
        times = [per_call_ms(lambda f=f, x=x: f(x)) for f in (bf16, q8, q4)]
        print(f"| {name} {out_f}x{in_f} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
