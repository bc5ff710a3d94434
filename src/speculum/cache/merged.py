"""A positioned cache whose slots may hold merged entries: a cluster of ``s`` similar tokens kept as one
key and value, read with an additive attention bias ``log s`` (Chelsea).

Why the bias: ``s`` keys close to their centroid ``k`` together receive about ``s * exp(q.k)`` of
the attention's unnormalised weight, and their values about that times their mean ``v``. One slot
holding ``k`` and ``v`` with ``log s`` added to its logit receives exactly that, so the weights of
the other slots stay as they were (ToMe's proportional attention, Bolya et al., 2023). Slots
holding a single token have bias 0.

``bias [layers, H_kv, C]`` (the cache's dtype) is allocated at the first merge
(:meth:`MergedKVCache.set_bias`); a layer without merged slots attends exactly as
:class:`~speculum.cache.PositionedKVCache` does. Sparse reads (:meth:`attend_slots`,
:meth:`attend_block`) do not see the bias: no sparse-read policy stores merged entries.
"""

from __future__ import annotations

import torch

from ..attention import Step
from .positioned import PositionedKVCache


class MergedKVCache(PositionedKVCache):
    """:class:`~speculum.cache.PositionedKVCache` plus a per-slot attention bias.

    Attributes:
        bias: ``[layers, H_kv, C]`` additive logit bias of each slot (``log`` of its cluster size),
            or None until a layer stores merged entries.
        biased: ``[layers]`` whether a layer has a nonzero bias.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias: torch.Tensor | None = None
        self.biased = [False] * self.layout.layers

    # -- storage -------------------------------------------------------------------------------
    def set_bias(self, layer: int, bias: torch.Tensor) -> None:
        """The bias ``[H_kv, m]`` of slots ``0 .. m-1`` of ``layer`` (its stored prompt entries)."""
        if self.bias is None:
            self.bias = torch.zeros(self.pos.shape, dtype=self.dtype, device=self.device)
        self.bias[layer, :, : bias.shape[1]] = bias
        self.biased[layer] = True

    def entry_bytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.shape[0] * self.bias.shape[1] * self.bias.element_size()
        return super().entry_bytes() + extra

    def _grow(self, extra: int) -> None:
        super()._grow(extra)
        if self.bias is not None:
            bias = torch.zeros(self.pos.shape, dtype=self.dtype, device=self.device)
            bias[:, :, : self.length] = self.bias[:, :, : self.length]
            self.bias = bias

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        super()._move_entries(src, dst)
        if self.bias is not None:
            self.bias[:, :, dst:dst + src.shape[0]] = self.bias.index_select(2, src)

    def begin(self, positions: torch.Tensor) -> None:
        super().begin(positions)
        if self.bias is not None:  # new tokens are single entries
            self.bias[:, :, self.length:self.length + positions.shape[0]] = 0

    @torch.inference_mode()
    def keep_slots(self, idx: torch.Tensor) -> None:
        if self.bias is not None:
            self.bias[:, :, : idx.shape[2]] = self.bias[:, :, : self.length].gather(2, idx)
        super().keep_slots(idx)

    # -- attention -------------------------------------------------------------------------------
    def mask(self, layer: int, sliding: bool, step: Step, start: int = 0) -> torch.Tensor | None:
        """:meth:`PositionedKVCache.mask` plus the slots' bias: ``[H_kv, g*n, L]`` where ``layer`` holds
        merged entries."""
        mask = super().mask(layer, sliding, step, start)
        if not self.biased[layer]:
            return mask
        bias = self.bias[layer, :, start:self.length + step.n][:, None]  # [H_kv, 1, L]
        return bias.expand(-1, self.layout.group * step.n, -1) if mask is None else mask + bias
