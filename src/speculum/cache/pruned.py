"""ThinK's cache (Xu et al., 2024): older prompt entries whose keys keep only chosen channels, then
whole entries.

The :class:`~speculum.cache.PositionedKVCache` buffer ``kv [layers, 2, H_kv, C, d]`` holds the whole
entries: the prompt's most recent tokens and every token generated after them. The older prompt
tokens form a per-layer *prefix*: keys ``[H_kv, P, d_k]`` with only the channels ``[H_kv, d_k]``
chosen for each KV head, values ``[H_kv, P, d]`` whole. Attention takes each query's chosen
channels against the prefix's keys and all of them against the whole entries, under one softmax
(:func:`~speculum.attention.attention_parts`), so the pruned channels are neither stored nor read.

Example: head dim 64, 40% pruned: a prefix key keeps 38 channels (``64 - round(0.4 * 64)``); with
bfloat16 a prefix entry costs 76 + 128 bytes per head instead of 256.
"""

from __future__ import annotations

import torch

from ..attention import (
    AttentionLayout,
    Step,
    attention_parts,
    grouped,
    in_window,
    window_first_slot,
)
from .positioned import PositionedKVCache


class ChannelPrunedKVCache(PositionedKVCache):
    """A channel-pruned prompt prefix before a :class:`PositionedKVCache` of whole entries.

    Attributes (per layer; None where a layer has no prefix):
        prefix: prompt entries in the prefix (the same in every layer and head).
        pk: ``[H_kv, P, d_k]`` the prefix's keys, channels ``chan`` only (all ``d`` where ``chan`` is None).
        pv: ``[H_kv, P, d]`` the prefix's values.
        chan: ``[H_kv, d_k]`` int64 kept key channels, increasing; None: keys whole (sliding layers).
        ppos: ``[H_kv, P]`` positions of the prefix's entries (sliding layers, for their window).
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int):
        super().__init__(layout, dtype, device, capacity_hint)
        self.prefix = 0
        self.pk: list[torch.Tensor | None] = [None] * layout.layers
        self.pv: list[torch.Tensor | None] = [None] * layout.layers
        self.chan: list[torch.Tensor | None] = [None] * layout.layers
        self.ppos: list[torch.Tensor | None] = [None] * layout.layers

    @property
    def position(self) -> int:
        return self.length + self.evicted + self.prefix

    @property
    def contiguous(self) -> bool:
        return (self.evicted == 0 and self.prefix == 0) or self.rolling

    def store_split(self, layer: int, kv: torch.Tensor, positions: torch.Tensor, whole: int,
                    chan: torch.Tensor | None) -> None:
        """Store one layer's kept prompt entries ``kv [2, H_kv, m, d]`` at ``positions [H_kv, m]``
        (increasing): the last ``whole`` whole, the others as the prefix with key channels ``chan``."""
        p = kv.shape[2] - whole
        self.kv[layer, :, :, :whole] = kv[:, :, p:]
        self.pos[layer, :, :whole] = positions[:, p:]
        if p:
            keys = kv[0, :, :p]
            self.pk[layer] = keys.clone() if chan is None else keys.gather(-1, chan[:, None, :].expand(-1, p, -1))
            self.pv[layer], self.chan[layer] = kv[1, :, :p].clone(), chan
            self.ppos[layer] = positions[:, :p].clone() if self.layout.is_sliding(layer) else None

    def nbytes(self) -> int:
        """Whole entries, and the prefix's pruned keys, values and channel indices."""
        held = [t for ts in (self.pk, self.pv, self.chan) for t in ts if t is not None]
        return super().nbytes() + sum(t.numel() * t.element_size() for t in held)

    def attend_pruned(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      step: Step) -> torch.Tensor:
        """Write the new entries ``k, v [n, H_kv, d]`` and attend ``q [n, H, d]`` over the prefix
        (its channels) and the whole entries -> ``[n, H*d]``."""
        self.write(layer, k, v)
        end = self.length + step.n
        mask = self.mask(layer, sliding, step)
        whole = (self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end], mask, None)
        if self.pk[layer] is None:
            return self.attend(q, whole[0], whole[1], mask)
        pk, pv, pmask = self.pk[layer], self.pv[layer], None
        if sliding:  # only the prefix's entries from the window's first position on (positions increase)
            first = window_first_slot(self.ppos[layer], step.positions, self.layout.window)
            if first == pk.shape[1]:
                return self.attend(q, whole[0], whole[1], mask)
            pk, pv = pk[:, first:], pv[:, first:]
            vis = in_window(self.ppos[layer][:, first:], step.positions, self.layout.window)  # [H_kv, n, P']
            pmask = None if bool(vis.all()) else grouped(vis, self.layout.group, self.dtype)
        prefix = (pk, pv, pmask, self.chan[layer])
        return attention_parts(q, [prefix, whole], self.layout.scale, self.layout.softcap)
