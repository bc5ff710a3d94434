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
from ..runners.decoder import NativeDecoder


class LayerSubset:
    """``layers`` (indices into ``decoder.layers``, in order) of ``decoder`` over an own KV buffer."""

    def __init__(self, decoder: NativeDecoder, layers: Sequence[int], capacity: int = 1024):
        self.decoder, self.layers = decoder, list(layers)
        s = decoder.shape
        self.kv = torch.zeros(len(self.layers), 2, s.kv_heads, capacity, s.head_dim, dtype=decoder.dtype,
                              device=decoder.device)  # [l, 2, H_kv, C, d]
        self.slot_pos = torch.zeros(capacity, dtype=torch.int64, device=decoder.device)  # [C] each slot's position
        self.committed = self.used = 0

    def reserve(self, n: int) -> None:
        """Room for ``n`` entries in all."""
        if n > self.kv.shape[3]:
            size = max(n, 2 * self.kv.shape[3])
            kv = self.kv.new_zeros(*self.kv.shape[:3], size, self.kv.shape[4])
            kv[:, :, :, :self.used] = self.kv[:, :, :, :self.used]
            pos = self.slot_pos.new_zeros(size)
            pos[:self.used] = self.slot_pos[:self.used]
            self.kv, self.slot_pos = kv, pos

    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [n]`` at ``positions [n]`` through the subset, written to slots ``used .. used + n - 1``;
        ``visible [n, used + n]`` bool. Returns the last layer's output ``[n, D]`` (no norm)."""
        dec, s = self.decoder, self.decoder.shape
        n, at = ids.shape[0], self.used
        self.reserve(at + n)
        keys = at + n
        self.slot_pos[at:keys] = positions
        masks = {False: grouped(visible, s.group, dec.dtype), True: None}
        if s.sliding_window is not None:
            near = in_window(self.slot_pos[:keys], positions, s.sliding_window)
            masks[True] = grouped(visible & near, s.group, dec.dtype)
        kv = self.kv

        def attend(j: int, layer, q, k, v):
            kv[j, 0, :, at:keys] = k.transpose(0, 1)
            kv[j, 1, :, at:keys] = v.transpose(0, 1)
            return dec.attend(q, kv[j, 0, :, :keys], kv[j, 1, :, :keys], masks[layer.sliding])

        h = dec.embed_ids(ids)
        rope = dec.rope(positions)
        for j, i in enumerate(self.layers):
            h = dec.layer_forward(j, dec.layers[i], h, rope, attend)
        self.used = keys
        return h

    def commit(self) -> None:
        self.committed = self.used

    def rollback(self) -> None:
        self.used = self.committed
