"""Ragged KV storage: every layer keeps its own number of prompt entries, and within a layer every
KV head may keep its own (the budget-allocation policies: PyramidKV, CAKE, AdaKV in :mod:`speculum.kv`).

:class:`~speculum.cache.PositionedKVCache` holds one ``[layers, 2, H_kv, C, d]`` buffer, so every
layer and head keeps the same count. Here each layer has its own buffer ``kv[l] [2, H_kv, C_l, d]``,
allocated at the size that layer keeps plus the room decoding needs: a layer that keeps fewer
entries really holds less memory.

Layer ``l`` keeps ``P_l`` prompt slots, the most any of its heads keeps; tokens fed after the prompt
are appended to every layer and head alike::

    slots 0 .. P_l-1            prompt entries: head h holds its c_h <= P_l kept entries first (in
                                increasing positions), then P_l - c_h padded slots
    slots P_l .. P_l+T-1        the T tokens committed since the prompt (the same T in every layer)
    slots P_l+T ..              a forward's pending entries, then free room

Padded slots hold zeros at position -1 and attention masks them out, but they occupy memory all the
same: :meth:`RaggedKVCache.nbytes` counts them (AdaKV's heads of one layer cost the longest head's
count each). Positions ``pos[l] [H_kv, C_l]`` also serve the sliding-window rule (Gemma-3), which
compares each slot's position with the query's, since after selection slot ``c`` no longer holds
position ``c``.

Lengths: :attr:`~speculum.cache.base.KVCache.length` counts the committed entries of the widest
layer (``P_max + T``); layer ``l`` holds ``length - lag[l]`` with ``lag[l] = P_max - P_l``, so the
base class's pending/commit protocol (one shared ``length``, pending entries after it, a commit that
gathers the accepted path) applies to every layer at its own offset. The prompt entries, once
selected, are never moved again: a rollback may not reach into them.

Example: a 10-token prompt, 3 layers keeping 6, 4 and 2 entries, then 3 tokens decoded: the layers
hold 9, 7 and 5 entries, ``length`` is 9 (lags 0, 2, 4) and the next token is fed at position 13.

Use: :meth:`RaggedKVCache.plan` (prompt length, room past it), then :meth:`~RaggedKVCache.store_layer`
once per layer (and :meth:`~RaggedKVCache.reselect` to shrink a layer stored earlier, CAKE's cascade),
then :meth:`~RaggedKVCache.end_prefill`; from there on the engine's forwards and commits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..attention import (
    AttentionLayout,
    Step,
    attention,
    grouped,
    in_window,
    visibility,
    window_first_slot,
    window_start,
)
from .base import KVCache
from .kernels import kernels_for, mask3
from .store import put

Keep = torch.Tensor | Sequence[torch.Tensor] | None  # [H_kv, m] slots, one [m_h] row per head, or all


class RaggedKVCache(KVCache):
    """Per-layer buffers sized to what each layer keeps; per-head counts padded to the layer's longest head.

    Attributes:
        kv: ``[layers]`` of ``[2, H_kv, C_l, d]``.
        pos: ``[layers]`` of ``[H_kv, C_l]`` int64, the position each slot holds (-1: padding or free).
        counts: ``[layers, H_kv]`` int64 prompt entries each head kept (padding excluded).
        prefix: ``[layers]`` prompt slots of each layer (``P_l``, the largest of its heads' counts).
        contiguous: ``[layers]`` True where the layer kept the whole prompt (slot ``c`` holds position ``c``).
        room: slots after each layer's prompt slots for appended and pending entries (grows by doubling).
        prompt: prompt tokens the cache was prefilled with.
        capacity_hint: prompt + new tokens + draft nodes, as the engine asked.
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int):
        super().__init__(device)
        self.layout, self.dtype, self.capacity_hint = layout, dtype, capacity_hint
        layers, heads = layout.layers, layout.kv_heads
        self.kv: list[torch.Tensor] = [self._zeros(0) for _ in range(layers)]
        self.pos: list[torch.Tensor] = [self._free(0) for _ in range(layers)]
        self.counts = torch.zeros((layers, heads), dtype=torch.long)
        self.prefix = [0] * layers
        self.contiguous = [True] * layers
        self.padded = [False] * layers  # some head of the layer keeps fewer than prefix[l]
        self.stored = [False] * layers
        self.room = 0
        self.prompt = 0
        self.top = 0  # the widest layer's prompt slots (P_max), once prefilled
        self.lag = [0] * layers

    def _zeros(self, slots: int) -> torch.Tensor:
        s = self.layout
        # zeros: padded slots are read (and masked), so they must hold finite numbers
        return torch.zeros((2, s.kv_heads, slots, s.head_dim), dtype=self.dtype, device=self.device)

    def _free(self, slots: int) -> torch.Tensor:
        return torch.full((self.layout.kv_heads, slots), -1, dtype=torch.long, device=self.device)

    # -- prefill -------------------------------------------------------------------------------
    def plan(self, prompt: int, room: int) -> None:
        """Before the prompt's layers are stored: its length and the slots to leave after each layer's
        prompt entries (new tokens and draft nodes; more are added by doubling when needed)."""
        if self.length or self.pending or any(self.stored):
            raise RuntimeError("plan a ragged cache before storing anything in it")
        self.prompt, self.room = prompt, max(room, 1)

    def store_layer(self, layer: int, kv: torch.Tensor, keep: Keep) -> None:
        """Store one layer's prompt entries ``kv [2, H_kv, n, d]``, keeping the slots ``keep``: None (all
        ``n``), ``[H_kv, m]`` (``m`` per head) or one increasing ``[m_h]`` row per head (ragged heads)."""
        n = kv.shape[2]
        pos = torch.arange(n, device=self.device).expand(self.layout.kv_heads, n)
        self._set_layer(layer, kv, pos, keep)
        self.contiguous[layer] = keep is None
        self.stored[layer] = True

    def reselect(self, layer: int, keep: Keep) -> None:
        """During prefill, shrink a stored layer to the slots ``keep`` of its prompt slots (rows as in
        :meth:`store_layer`, each indexing that head's kept entries); its buffer is reallocated smaller."""
        if self.length:
            raise RuntimeError("a ragged cache's layers are reselected during prefill only")
        p = self.prefix[layer]
        rows = self._rows(keep, p)
        for h, row in enumerate(rows):
            if row.numel() and int(row.max()) >= int(self.counts[layer, h]):
                raise IndexError(f"layer {layer} head {h} keeps {int(self.counts[layer, h])} entries; slot "
                                 f"{int(row.max())} asked for")
        self._set_layer(layer, self.kv[layer][:, :, :p], self.pos[layer][:, :p], rows)
        self.contiguous[layer] = False

    def _rows(self, keep: Keep, n: int) -> list[torch.Tensor]:
        if keep is None:
            return [torch.arange(n, device=self.device)] * self.layout.kv_heads
        return list(keep)

    def _set_layer(self, layer: int, src: torch.Tensor, src_pos: torch.Tensor, keep: Keep) -> None:
        """Layer ``layer`` becomes the slots ``keep`` of ``src [2, H_kv, N, d]`` at ``src_pos [H_kv, N]``,
        each head's rows first, padded to the longest, then ``room`` free slots."""
        if keep is None:
            p = src.shape[2]
            kv, pos = self._zeros(p + self.room), self._free(p + self.room)
            kv[:, :, :p], pos[:, :p] = src, src_pos
            counts = [p] * self.layout.kv_heads
        else:
            rows = self._rows(keep, src.shape[2])
            counts = [int(r.numel()) for r in rows]
            p = max(counts, default=0)
            kv, pos = self._zeros(p + self.room), self._free(p + self.room)
            for h, row in enumerate(rows):
                kv[:, h, :counts[h]] = src[:, h].index_select(1, row)
                pos[h, :counts[h]] = src_pos[h].index_select(0, row)
        self.kv[layer], self.pos[layer] = kv, pos  # the layer's previous buffer is freed here
        self.counts[layer] = torch.tensor(counts)
        self.prefix[layer] = p
        self.padded[layer] = min(counts, default=0) < p

    def end_prefill(self) -> None:
        """After every layer is stored (layers never stored keep nothing): the shared length starts."""
        for layer, done in enumerate(self.stored):
            if not done:
                self.store_layer(layer, self._zeros(0), None)
        self.top = max(self.prefix, default=0)
        self.lag = [self.top - p for p in self.prefix]
        self.length, self.pending = self.top, 0
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    # -- KVCache ---------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Position of the next token: its place in the text (the prompt, then what was appended)."""
        return self.prompt + self.length - self.top

    def width(self, layer: int) -> int:
        """Committed slots of ``layer`` (its prompt slots, padding included, and the appended tokens)."""
        return self.length - self.lag[layer]

    @property
    def capacity(self) -> int:
        return self.top + self.room

    def _growth_unit(self) -> int:
        return self.room  # the room after the prompt doubles; the prompt slots never grow

    def _grow(self, extra: int) -> None:
        self.room += extra
        for layer, p in enumerate(self.prefix):
            w = self.width(layer)
            kv, pos = self._zeros(p + self.room), self._free(p + self.room)
            kv[:, :, :w], pos[:, :w] = self.kv[layer][:, :, :w], self.pos[layer][:, :w]
            self.kv[layer], self.pos[layer] = kv, pos

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """Slots ``src [m]`` -> ``dst .. dst+m-1`` in the shared numbering, each layer at its own offset."""
        m = src.shape[0]
        for layer, lag in enumerate(self.lag):
            at = src - lag
            self.kv[layer][:, :, dst - lag:dst - lag + m] = self.kv[layer].index_select(2, at)
            self.pos[layer][:, dst - lag:dst - lag + m] = self.pos[layer].index_select(1, at)

    def entry_bytes(self) -> int:
        """Bytes of one slot in every layer (keys and values)."""
        s = self.layout
        return s.layers * 2 * s.kv_heads * s.head_dim * self.kv[0].element_size()

    def nbytes(self) -> int:
        """Bytes of the committed slots of every layer, padded slots included (they are allocated and
        read like the others); 0 until :meth:`end_prefill`."""
        s = self.layout
        slot = 2 * s.kv_heads * s.head_dim * self.kv[0].element_size()
        if not self.length:
            return 0
        return sum(self.width(layer) for layer in range(s.layers)) * slot

    def kept(self) -> int:
        """Prompt entries kept over all layers and heads, padding excluded."""
        return int(self.counts.sum())

    def rollback(self, length: int) -> None:
        if length < self.top:
            raise ValueError(f"cannot roll back to {length}: the selected prompt entries end at {self.top}")
        super().rollback(length)

    def begin(self, positions: torch.Tensor) -> None:
        """Make room for a forward's new tokens and record their positions in every layer and head."""
        n = positions.shape[0]
        self.reserve(self.length + n)
        for layer in range(self.layout.layers):
            w = self.width(layer)
            self.pos[layer][:, w:w + n] = positions

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New entries ``k, v [n, H_kv, d]`` into the pending slots of ``layer``."""
        put(self.kv[layer], self.width(layer), k, v)

    # -- attention -------------------------------------------------------------------------------
    def visible(self, layer: int, sliding: bool, step: Step) -> tuple[int, torch.Tensor | None]:
        """The first slot read and which of slots ``start .. width+n-1`` the new tokens see: bool ``[n, L]``
        (every head alike: a layer that kept the whole prompt, as the plain cache), ``[H_kv, n, L]``
        (padded heads, or a sliding window over selected positions), or None (all of them). A sliding
        layer starts at the first slot any head holds inside the window (unless padded: slots of a
        padded head are not in position order)."""
        s, w, n = self.layout, self.width(layer), step.n
        window = s.window if sliding else None
        if self.contiguous[layer]:
            start = window_start(step.positions, window)
            return start, visibility(w, step.positions, step.new_mask, window, start)[1]
        start = 0 if self.padded[layer] else window_first_slot(self.pos[layer][:, :w], step.positions, window)
        vis = visibility(w, step.positions, step.new_mask, None, start)[0]  # [n, L] or None
        pos = self.pos[layer][:, start:w + n]  # [H_kv, L]
        heads = []  # per-head rules, each [H_kv, 1 or n, L]
        if self.padded[layer]:
            heads.append((pos >= 0)[:, None, :])
        if window is not None:
            heads.append(in_window(pos, step.positions, window))
        if not heads:
            return start, vis
        full = torch.ones((s.kv_heads, n, w + n - start), dtype=torch.bool, device=self.device)
        for rule in heads:
            full &= rule
        if vis is not None:
            full &= vis
        if n == 1 and bool(full.all()):
            return start, None
        return start, full

    def attend_all(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   step: Step) -> torch.Tensor:
        """Write the new entries ``k, v [n, H_kv, d]`` and attend ``q [n, H, d]`` over every held slot of
        ``layer`` (padding masked; a sliding layer over its window) -> ``[n, H*d]``, read in place by the
        KV kernels where they serve."""
        self.write(layer, k, v)
        s, w = self.layout, self.width(layer)
        start, vis = self.visible(layer, sliding, step)
        kv = self.kv[layer]
        ops = kernels_for(q, s.head_dim)
        if ops is not None:
            return ops.slot_attend(q, kv[0], kv[1], None, start, w, step.n, mask3(vis), s.scale, s.softcap or 0.0)
        end = w + step.n
        return attention(q, kv[0, :, start:end], kv[1, :, start:end], grouped(vis, s.group, self.dtype), s.scale,
                         s.softcap)
