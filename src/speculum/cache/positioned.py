"""The cache KV policies work on: a static cache whose slots remember their positions, per layer and KV head.

``kv [layers, 2, H_kv, C, d]`` as in :class:`~speculum.cache.static.StaticKVCache`, plus
``pos [layers, H_kv, C]``, the position each slot holds. Without eviction slot ``c`` holds position
``c``; an eviction policy gathers the slots it keeps to the front, per layer and per head, so the
same slot index then holds different positions in different heads. Keys are stored after rotary
embedding, so they keep their original positions wherever they move; the positions are needed for
the sliding-window rule (Gemma-3) and to number new tokens (:attr:`PositionedKVCache.position`).

*Rolling* positions (StreamingLLM): a token's position is its slot in the cache, not its place in
the text. New tokens are numbered from ``length``, and an eviction that moves a kept key from slot
``p`` to slot ``j`` rotates it by ``j - p`` (:meth:`~speculum.attention.Rotary.shift`), so the
positions the model sees never exceed the cache's size and generation can run past the model's
context length.

The new entries of a forward go to slots ``length .. length+n-1`` (the same in every layer and
head) and stay pending until :meth:`commit`, as in every cache of the engine.
"""

from __future__ import annotations

import torch

from ..attention import (
    AttentionLayout,
    Step,
    attention,
    attention_probs,
    grouped,
    in_window,
    visibility,
    window_first_slot,
    window_start,
)
from .kernels import kernels_for, mask3
from .static import StaticKVCache
from .store import put


class PositionedKVCache(StaticKVCache):
    """Slots with positions, eviction by gather, optional per-slot scores (H2O), optional rolling positions.

    Attributes:
        pos: ``[layers, H_kv, C]`` int64 position held by each slot.
        score: ``[layers, H_kv, C]`` float32 accumulated attention, when the policy keeps one.
        evicted: tokens dropped so far.
        capacity_hint: prompt + new tokens + draft nodes, as the engine asked.
        rolling: positions are slots (StreamingLLM), not places in the text.
    """

    def __init__(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity_hint: int,
                 with_scores: bool = False, rolling: bool = False):
        super().__init__(layout.layers, layout.kv_heads, layout.head_dim, dtype, device, 0)
        self.layout = layout
        self.capacity_hint = capacity_hint
        self.rolling = rolling
        if rolling and len(layout.rotary) != layout.layers:
            raise ValueError("rolling positions need each layer's rotary embedding")
        self.pos = torch.empty((layout.layers, layout.kv_heads, 0), dtype=torch.long, device=self.device)
        self.score = torch.empty_like(self.pos, dtype=torch.float32) if with_scores else None
        self.evicted = 0

    # -- storage -------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Position of the next token: its slot when rolling, else its place in the text."""
        return self.length if self.rolling else self.length + self.evicted

    @property
    def contiguous(self) -> bool:
        """True while slot ``c`` holds position ``c`` in every layer and head."""
        return self.evicted == 0 or self.rolling

    def _grow(self, extra: int) -> None:
        super()._grow(extra)
        pos = torch.zeros((*self.pos.shape[:2], self.capacity), dtype=torch.long, device=self.device)
        pos[:, :, : self.length] = self.pos[:, :, : self.length]
        self.pos = pos
        if self.score is not None:
            score = torch.zeros(pos.shape, dtype=torch.float32, device=self.device)
            score[:, :, : self.length] = self.score[:, :, : self.length]
            self.score = score

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        super()._move_entries(src, dst)
        m = src.shape[0]
        self.pos[:, :, dst:dst + m] = self.pos.index_select(2, src)
        if self.score is not None:
            self.score[:, :, dst:dst + m] = self.score.index_select(2, src)

    def store_layer(self, layer: int, kv: torch.Tensor, idx: torch.Tensor | None) -> int:
        """Store prompt entries of one layer: ``kv [2, H_kv, n, d]``, keeping slots ``idx [H_kv, m]``
        (increasing along ``m``; None keeps all ``n``). Returns ``m``. Rolling: the kept keys move
        to the positions of their new slots."""
        n = kv.shape[2]
        if idx is None:
            self.kv[layer, :, :, :n] = kv
            self.pos[layer, :, :n] = torch.arange(n, device=self.device)
            return n
        m = idx.shape[1]
        for h in range(kv.shape[1]):
            torch.index_select(kv[:, h], 1, idx[h], out=self.kv[layer, :, h, :m])
        self.pos[layer, :, :m] = idx
        if self.rolling:
            self._roll(layer, m)
        return m

    def begin(self, positions: torch.Tensor) -> None:
        """Make room for a forward's new tokens and record their positions (every layer and head)."""
        n = positions.shape[0]
        self.reserve(self.length + n)
        self.pos[:, :, self.length:self.length + n] = positions
        if self.score is not None:
            self.score[:, :, self.length:self.length + n] = 0

    @torch.inference_mode()
    def keep_slots(self, idx: torch.Tensor) -> None:
        """Evict: keep committed slots ``idx [layers, H_kv, m]`` (increasing along ``m``), moved to the front."""
        L, _, H, _, d = self.kv.shape
        m = idx.shape[2]
        # one layer's scratch, not a second cache: a [layers, ...] copy would briefly double the memory
        # the cache holds at every eviction
        kept = torch.empty((2, H, m, d), dtype=self.dtype, device=self.device)
        for layer in range(L):
            for h in range(H):  # index_select copies whole rows, where gather reads element by element
                torch.index_select(self.kv[layer, :, h], 1, idx[layer, h], out=kept[:, h])
            self.kv[layer, :, :, :m] = kept
        self.pos[:, :, :m] = self.pos[:, :, : self.length].gather(2, idx)
        if self.score is not None:
            self.score[:, :, :m] = self.score[:, :, : self.length].gather(2, idx)
        self.evicted += self.length - m
        self.length = m
        if self.rolling:
            for layer in range(L):
                self._roll(layer, m)

    def _roll(self, layer: int, m: int) -> None:
        """Rolling positions: move the keys of slots ``0 .. m-1`` of ``layer`` from the positions they
        hold to their slot numbers."""
        slots = torch.arange(m, device=self.device)
        for h in range(self.kv.shape[2]):
            delta = slots - self.pos[layer, h, :m]  # [m]
            if bool((delta != 0).any()):
                self.kv[layer, 0, h, :m] = self.layout.rotary[layer].shift(self.kv[layer, 0, h, :m], delta)
        self.pos[layer, :, :m] = slots

    def gather_block(self, layers: list[int], idx: torch.Tensor, extra: int) -> torch.Tensor:
        """Copy the committed slots ``idx [H_kv, k]`` of ``layers`` (``m`` of them) into the front of a
        new ``[m, 2, H_kv, k + extra, d]`` block; the ``extra`` slots after them are left for new entries."""
        s = self.layout
        k = idx.shape[1]
        block = torch.empty((len(layers), 2, s.kv_heads, k + extra, s.head_dim), dtype=self.dtype,
                            device=self.device)
        if layers and layers == list(range(layers[0], layers[-1] + 1)):  # one copy per head for all of them
            for h in range(s.kv_heads):
                torch.index_select(self.kv[layers[0]:layers[-1] + 1, :, h], 2, idx[h], out=block[:, :, h, :k])
            return block
        for j, layer in enumerate(layers):
            for h in range(s.kv_heads):
                torch.index_select(self.kv[layer, :, h], 1, idx[h], out=block[j, :, h, :k])
        return block

    # -- attention -------------------------------------------------------------------------------
    def window_start(self, layer: int, sliding: bool, step: Step) -> int:
        """First slot a sliding layer's new tokens can see (0 on other layers): the window's first
        position while slots equal positions; after an eviction, the first slot of any head that holds
        a position inside the window (each head's slots hold increasing positions)."""
        if not sliding:
            return 0
        if self.contiguous:
            return window_start(step.positions, self.layout.window)
        return window_first_slot(self.pos[layer, :, : self.length], step.positions, self.layout.window)

    def visible(self, layer: int, sliding: bool, step: Step, start: int = 0) -> torch.Tensor | None:
        """Which of slots ``start .. length+n-1`` the new tokens see: bool ``[n, L]`` (the same for every
        head) or ``[H_kv, n, L]`` (sliding layers after eviction), or None (all of them)."""
        window = self.layout.window if sliding else None
        if self.contiguous or window is None:
            return visibility(self.length, step.positions, step.new_mask, window, start)[1]
        n, a = step.n, self.length
        vis = visibility(a, step.positions, step.new_mask, None, start)[0]  # [n, L] or None
        near = in_window(self.pos[layer, :, start:a + n], step.positions, window)  # [H_kv, n, L]
        vis = near if vis is None else vis & near
        if n == 1 and bool(vis.all()):
            return None
        return vis

    def mask(self, layer: int, sliding: bool, step: Step, start: int = 0) -> torch.Tensor | None:
        """:meth:`visible` as an additive mask for the folded query rows: ``[g*n, L]`` or ``[H_kv, g*n, L]``."""
        return grouped(self.visible(layer, sliding, step, start), self.layout.group, self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``q [n, H, d]`` over ``k, v [H_kv, L, d]`` with this model's scale and soft-capping -> ``[n, H*d]``."""
        return attention(q, k, v, mask, self.layout.scale, self.layout.softcap)

    def attend_all(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   step: Step) -> torch.Tensor:
        """Write the new entries and attend over every held slot (a sliding layer over its window)."""
        self.write(layer, k, v)
        end = self.length + step.n
        start = self.window_start(layer, sliding, step)
        # in place (a torch attention over a slice of the buffer copies its keys first), unless a subclass
        # adds to the mask (a bias: Chelsea's merged entries), which the kernel does not take
        ops = kernels_for(q, self.layout.head_dim) if type(self).mask is PositionedKVCache.mask else None
        if ops is not None:
            s = self.layout
            return ops.slot_attend(q, self.kv[layer, 0], self.kv[layer, 1], None, start, self.length, step.n,
                                   mask3(self.visible(layer, sliding, step, start)), s.scale, s.softcap or 0.0)
        mask = self.mask(layer, sliding, step, start)
        return self.attend(q, self.kv[layer, 0, :, start:end], self.kv[layer, 1, :, start:end], mask)

    def slot_probs(self, layer: int, q: torch.Tensor, end: int, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention weights ``[H_kv, g*n, end]`` (float32, rows folded) of ``q [n, H, d]`` over slots
        ``0 .. end-1`` of ``layer``, row ``i`` seeing the slots where ``visible`` (bool ``[n, end]``; None: all)
        is True, for policies that score tokens by attention. The keys are read in place (``slot_scores``);
        :func:`~speculum.attention.attention_probs` over a copy of them where the kernels are not built."""
        s = self.layout
        ops = kernels_for(q, s.head_dim)
        if ops is None:
            mask = None if visible is None else grouped(visible, s.group, torch.float32)
            return attention_probs(q, self.kv[layer, 0, :, :end], mask, s.scale, s.softcap)
        logits = ops.slot_scores(q, self.kv[layer, 0], None, 0, end, mask3(visible), s.scale, s.softcap or 0.0)
        logits = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # the softmax in place: no second [.., end]
        return logits.div_(logits.sum(-1, keepdim=True))

    def attend_slots(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     step: Step) -> torch.Tensor:
        """Sparse read of chosen committed slots: write the new entries ``k, v [n, H_kv, d]`` and attend
        ``q [n, H, d]`` over slots ``slots [H_kv, m]`` (int64, increasing along ``m``) of ``layer`` and the
        new entries -> ``[n, H*d]``. Every decode-time selection policy reads through here.

        The slots are read in place (``slot_attend``, :mod:`speculum.cache.kernels`), so a sparse read
        allocates nothing beyond the step's scores and memory stays at the cache's; where the kernels
        are not built (or off a CPU) they are gathered into a block and attended in torch
        (:meth:`attend_block`), with the same result to float rounding."""
        ops = kernels_for(q, self.layout.head_dim)
        if ops is None:
            return self.attend_block(layer, q, k, v, self.gather_block([layer], slots, step.n)[0], step)
        self.write(layer, k, v)
        new = visibility(0, step.positions, step.new_mask, None)[0]  # [n, n] among the new entries, or None
        s = self.layout
        return ops.slot_attend(q, self.kv[layer, 0], self.kv[layer, 1], slots, 0, self.length, step.n, mask3(new),
                               s.scale, s.softcap or 0.0)

    def attend_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None,
                    visible: torch.Tensor, step: Step) -> torch.Tensor:
        """:meth:`attend_slots` with a mask per query row: write the new entries ``k, v [n, H_kv, d]`` and
        attend ``q [n, H, d]`` over committed slots ``slots [H_kv, m]`` (increasing along ``m``; None: every
        committed slot, read in place) followed by the new entries, row ``i`` of KV head ``h`` seeing
        column ``c`` where ``visible [H_kv, n, m + n]`` is True (its columns ``m ..`` are the new
        entries: at most the row's tree ancestors and itself) -> ``[n, H*d]``. Each row of a tree step
        can so read what a one-token step at its position would (:mod:`speculum.kv.rows`). Read in place,
        as :meth:`attend_slots` reads (a gathered copy where the kernels are not built)."""
        n = step.n
        ops = kernels_for(q, self.layout.head_dim)
        if ops is not None:
            self.write(layer, k, v)
            s = self.layout
            return ops.slot_attend(q, self.kv[layer, 0], self.kv[layer, 1], slots, 0, self.length, n, mask3(visible),
                                   s.scale, s.softcap or 0.0)
        mask = grouped(visible, self.layout.group, self.dtype)  # [H_kv, g*n, m + n]
        if slots is None:
            self.write(layer, k, v)
            end = self.length + n
            return self.attend(q, self.kv[layer, 0, :, :end], self.kv[layer, 1, :, :end], mask)
        block = self.gather_block([layer], slots, n)[0]
        self.write(layer, k, v)
        put(block, slots.shape[1], k, v)
        return self.attend(q, block[0], block[1], mask)

    def attend_block(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: torch.Tensor,
                     step: Step) -> torch.Tensor:
        """Sparse read (TidalDecode, Quest): write the new entries ``k, v [n, H_kv, d]`` into the cache
        and after the ``c`` cached entries already in ``block [2, H_kv, c + n, d]``; attend over the block."""
        n = step.n
        self.write(layer, k, v)
        c = block.shape[2] - n
        put(block, c, k, v)
        mask = grouped(visibility(c, step.positions, step.new_mask, None)[0], self.layout.group, self.dtype)
        return self.attend(q, block[0], block[1], mask)
