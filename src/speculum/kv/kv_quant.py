"""``kv_quant``: KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"): 2- or 4-bit keys per channel and values per token, the most recent tokens in full
precision (:class:`~speculum.cache.QuantKVCache` holds the packed store)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import QuantKVCache
from ..errors import SpeculumError
from .base import KVPolicy


@dataclass
class QuantPrefillState:
    """One request's prefill split."""

    quantized: int  # prompt entries that go straight to the quantized store (whole groups)


class KVQuantPolicy(KVPolicy):
    """KIVI-style asymmetric low-bit KV cache (``bits`` 2 or 4). The budget does not apply."""

    name = "kv_quant"
    uses_budget = False

    def __init__(self, budget=None, bits: int = 4, group: int = 32, residual: int = 32):
        self.budget = None
        self.bits, self.group, self.residual = int(bits), int(group), int(residual)
        if self.bits not in (2, 4):
            raise SpeculumError(f"kv_quant takes 2 or 4 bits, got {bits}")

    def __repr__(self) -> str:
        return f"kv_quant(bits={self.bits})"

    def new_cache(self, layout, dtype, device, capacity: int) -> QuantKVCache:
        return QuantKVCache(layout, dtype, device, capacity, self.bits, self.group, self.residual)

    def begin_prefill(self, cache: QuantKVCache, n: int) -> None:
        cache.allocate(max(cache.capacity_hint, n + 1))
        t = max(0, (n - self.residual) // self.group * self.group)
        cache.state = QuantPrefillState(t)
        cache.reserve(n - t + self.group + 128)  # the residual window (tq is still 0)

    def store_prefill(self, cache: QuantKVCache, layer: int, sliding: bool, kv: torch.Tensor, scores) -> None:
        t = cache.state.quantized
        if t:
            cache.store_quantized(layer, kv[0, :, :t], kv[1, :, :t])
        cache.resid[layer, :, :, : kv.shape[2] - t] = kv[:, :, t:]

    def end_prefill(self, cache: QuantKVCache, n: int) -> None:
        cache.tq, cache.length = cache.state.quantized, n
        cache.peak_bytes = cache.nbytes()

    def attend(self, cache, layer, sliding, q, k, v, step):
        return cache.attend(layer, sliding, q, k, v, step)

    def draft_depth(self, cache: QuantKVCache) -> int | None:
        """No limit: plain decoding quantizes a group after the commit that fills the window to
        ``residual + group`` entries, and a tree's rows past that point read the group quantized
        (:class:`~speculum.cache.window.WindowKVCache`'s views), so trees need not stop there."""
        return None

    def after_commit(self, cache: QuantKVCache) -> None:
        cache.flush()
