"""Some of a native decoder's layers run over a KV buffer of their own: the cheap half of a
self-drafting model (Kangaroo's shallow sub-network; layer skipping).

The buffer holds ``committed`` entries (slot ``c`` = position ``c``) and then pending ones, written
by :meth:`LayerSubset.run` for drafted tokens at any positions and dropped by :meth:`rollback`. A
call's rows see the slots its ``visible`` mask allows (committed ones, their ancestors among the
pending, themselves), within the sliding window on sliding layers.

Shapes: ``n`` rows, ``D`` hidden size, ``l`` layers in the subset, ``H_kv`` / ``d`` the KV heads
and head dim, ``C`` capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..attention import grouped, in_window
from ..cache.store import BufferStore, DraftBuffer
from ..runners.decoder import NativeDecoder


class LayerSubset(DraftBuffer):
    """``layers`` (indices into ``decoder.layers``, in order) of ``decoder`` over a
    :class:`~speculum.cache.store.DraftBuffer` of their own (this object)."""

    def __init__(self, decoder: NativeDecoder, layers: Sequence[int], capacity: int = 1024):
        self.decoder, self.layers = decoder, list(layers)
        s = decoder.shape
        super().__init__(len(self.layers), s.kv_heads, s.head_dim, capacity, decoder.dtype, decoder.device)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [n]`` at ``positions [n]`` through the subset, written to slots ``used .. used + n - 1``;
        ``visible [n, used + n]`` bool. Returns the last layer's output ``[n, D]`` (no norm)."""
        dec, s = self.decoder, self.decoder.shape
        n, at = ids.shape[0], self.used
        self.reserve(at + n)
        keys = at + n
        self.pos[at:keys] = positions
        masks = {False: grouped(visible, s.group, dec.dtype), True: None}
        if s.sliding_window is not None:
            near = in_window(self.pos[:keys], positions, s.sliding_window)
            masks[True] = grouped(visible & near, s.group, dec.dtype)
        store = BufferStore(self.kv, at, keys, masks, dec.layout)
        h = dec.embed_ids(ids)
        rope = dec.rope(positions)
        for j, i in enumerate(self.layers):
            h = dec.layer_forward(j, dec.layers[i], h, rope, store)
        self.advance(n)
        return h
