"""What the decode-time sparse-attention policies (TidalDecode, Quest, and those choosing per query
row in :mod:`speculum.kv.rows`) share: the whole cache is stored (slot ``c`` holds position ``c``)
and the budget bounds how many cached tokens each full-attention layer *reads* per step. The first ``dense_layers`` layers and sliding-window
layers (which read only their window) always attend densely; a budget that covers the whole
context turns the policy into full attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PositionedKVCache
from .base import KVPolicy


@dataclass
class SparseState:
    """One request's read budget."""

    read: int  # cached tokens a sparse layer reads per step


class SparseReadPolicy(KVPolicy):
    """Full storage, sparse reads: subclasses implement :meth:`attend` (and may extend the state)."""

    dense_layers = 2

    def new_cache(self, layout, dtype, device, capacity: int) -> PositionedKVCache:
        return PositionedKVCache(layout, dtype, device, capacity)

    def new_state(self, cache: PositionedKVCache, read: int):
        """The request's state, made at prefill (subclasses return their own dataclass)."""
        return SparseState(read)

    def begin_prefill(self, cache: PositionedKVCache, n: int) -> None:
        cache.reserve(max(cache.capacity_hint, n + 1))
        cache.state = self.new_state(cache, self.budget.for_length(n))

    def store_prefill(self, cache: PositionedKVCache, layer: int, sliding: bool, kv: torch.Tensor, scores) -> None:
        cache.store_layer(layer, kv, None)

    def end_prefill(self, cache: PositionedKVCache, n: int) -> None:
        cache.length = n
        cache.peak_bytes = cache.nbytes()

    def dense(self, cache: PositionedKVCache, layer: int, sliding: bool) -> bool:
        """Layers that read everything: the first ones, sliding ones, and all while the context fits the budget."""
        return sliding or layer < self.dense_layers or cache.length <= cache.state.read
