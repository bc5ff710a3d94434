"""The cache KV policies work on: per-(layer, KV head) slots that remember their positions.

``kv [layers, 2, H_kv, C, d]`` like the native runner's static cache, plus ``pos [layers, H_kv, C]``:
the position each slot holds. Without eviction slot ``c`` holds position ``c``; an eviction
policy gathers the slots it keeps to the front, per layer and per head, so the same slot index
then holds different positions in different heads. Keys are stored after rotary embedding, so
they keep their original positions wherever they move; the positions are needed only for the
sliding-window rule (Gemma-3) and to number new tokens (:attr:`PolicyKVCache.position`).

The new entries of a forward go to slots ``length .. length+n-1`` (the same in every layer and
head) and stay pending until :meth:`commit`, as in every cache of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import grouped, in_window, visibility
from ..cache import PendingEntries


@dataclass
class Step:
    """What every layer's attention needs to know about one forward's ``n`` new tokens."""

    positions: torch.Tensor  # [n] rotary positions
    new_mask: torch.Tensor | None  # [n, n] bool among the new tokens (True = visible); None for one token
    decoder: object  # the NativeDecoder (attention kernel, scale, group size)
    window: int | None  # sliding window of the sliding layers

    @property
    def n(self) -> int:
        return self.positions.shape[0]


def sliding_start(step: Step, sliding: bool) -> int:
    """First position a sliding layer can still see for this step's queries (0 for other layers)."""
    if not sliding or step.window is None:
        return 0
    return max(0, int(step.positions.min()) - step.window + 1)


def contiguous_mask(step: Step, length: int, start: int, sliding: bool, group: int,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask ``[g*n, length - start + n]`` over slots ``start ..`` of a cache whose slot ``c``
    holds position ``c`` (the new tokens follow at ``length``), or None when every key is visible.
    Sliding layers hide keys ``window`` or more positions behind the query (transformers' rule)."""
    window = step.window if sliding else None
    return grouped(visibility(length, step.positions, step.new_mask, window, start)[1], group, dtype)


class PolicyKVCache(PendingEntries):
    """Slots with positions, eviction by gather, optional per-slot scores (H2O).

    Attributes:
        kv: ``[layers, 2, H_kv, C, d]`` (sized by :meth:`reserve` once the prompt length is known).
        pos: ``[layers, H_kv, C]`` int64 position held by each slot.
        score: ``[layers, H_kv, C]`` float32 accumulated attention, when the policy keeps one.
        length: committed slots (the same count in every layer and head).
        evicted: tokens dropped so far; ``position = length + evicted`` numbers the next token.
        peak_bytes: the most bytes the committed entries ever held (checked at each commit).
        capacity_hint: prompt + new tokens + draft nodes, as the engine asked.
        state: per-request scratch for the policy (TidalDecode's selection, Quest's page bounds).
    """

    def __init__(self, decoder, capacity_hint: int, with_scores: bool = False):
        s = decoder.shape
        self.shape, self.dtype, self.device = s, decoder.dtype, decoder.device
        self.capacity_hint = capacity_hint
        self.sliding = [layer.sliding for layer in decoder.layers]  # per layer: sliding-window attention
        self.with_scores = with_scores
        self.kv = torch.empty((s.layers, 2, s.kv_heads, 0, s.head_dim), dtype=self.dtype, device=self.device)
        self.pos = torch.empty((s.layers, s.kv_heads, 0), dtype=torch.long, device=self.device)
        self.score = None
        self.length = self.pending = self.evicted = 0
        self.peak_bytes = 0
        self.state: dict = {}

    # -- storage -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def position(self) -> int:
        """Position of the next token (committed tokens, evicted ones included)."""
        return self.length + self.evicted

    @property
    def contiguous(self) -> bool:
        """True while slot ``c`` holds position ``c`` in every layer and head (nothing evicted)."""
        return self.evicted == 0

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` slots (by doubling; committed slots are kept)."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        s = self.shape
        kv = torch.empty((s.layers, 2, s.kv_heads, new_cap, s.head_dim), dtype=self.dtype, device=self.device)
        kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        pos = torch.zeros((s.layers, s.kv_heads, new_cap), dtype=torch.long, device=self.device)
        pos[:, :, : self.length] = self.pos[:, :, : self.length]
        if self.with_scores:
            score = torch.zeros((s.layers, s.kv_heads, new_cap), dtype=torch.float32, device=self.device)
            if self.score is not None:
                score[:, :, : self.length] = self.score[:, :, : self.length]
            self.score = score
        self.kv, self.pos = kv, pos

    def nbytes(self) -> int:
        """Bytes of the committed entries (keys and values; positions and scores are bookkeeping)."""
        s = self.shape
        return self.length * s.layers * 2 * s.kv_heads * s.head_dim * self.kv.element_size()

    def store_layer(self, layer: int, kv: torch.Tensor, idx: torch.Tensor | None) -> int:
        """Store prompt entries of one layer: ``kv [2, H_kv, n, d]``, keeping slots ``idx [H_kv, m]``
        (increasing along ``m``; None keeps all ``n``). Returns ``m``."""
        n = kv.shape[2]
        if idx is None:
            self.kv[layer, :, :, :n] = kv
            self.pos[layer, :, :n] = torch.arange(n, device=self.device)
            return n
        m = idx.shape[1]
        for h in range(kv.shape[1]):
            torch.index_select(kv[:, h], 1, idx[h], out=self.kv[layer, :, h, :m])
        self.pos[layer, :, :m] = idx
        return m

    def begin(self, positions: torch.Tensor) -> None:
        """Make room for a forward's new tokens and record their positions (every layer and head)."""
        n = positions.shape[0]
        self.reserve(self.length + n)
        self.pos[:, :, self.length:self.length + n] = positions
        if self.score is not None:
            self.score[:, :, self.length:self.length + n] = 0

    def commit(self, keep: list[int] | None = None) -> None:
        super().commit(keep)
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        m = src.shape[0]
        self.kv[:, :, :, dst:dst + m] = self.kv.index_select(3, src)
        self.pos[:, :, dst:dst + m] = self.pos.index_select(2, src)
        if self.score is not None:
            self.score[:, :, dst:dst + m] = self.score.index_select(2, src)

    @torch.inference_mode()
    def keep_slots(self, idx: torch.Tensor) -> None:
        """Evict: keep committed slots ``idx [layers, H_kv, m]`` (increasing along ``m``), moved to the front."""
        L, _, H, _, d = self.kv.shape
        m = idx.shape[2]
        # one layer's scratch, not a second cache: a [layers, ...] copy would briefly double the memory
        # the cache holds at every eviction
        kept = torch.empty((2, H, m, d), dtype=self.dtype, device=self.device)
        for layer in range(L):
            for h in range(H):  # index_select copies whole rows: ~10x faster than gather here
                torch.index_select(self.kv[layer, :, h], 1, idx[layer, h], out=kept[:, h])
            self.kv[layer, :, :, :m] = kept
        self.pos[:, :, :m] = self.pos[:, :, : self.length].gather(2, idx)
        if self.score is not None:
            self.score[:, :, :m] = self.score[:, :, : self.length].gather(2, idx)
        self.evicted += self.length - m
        self.length = m

    def gather_block(self, layers: list[int], idx: torch.Tensor, extra: int) -> torch.Tensor:
        """Copy the committed slots ``idx [H_kv, k]`` of ``layers`` (``m`` of them) into the front of a
        new ``[m, 2, H_kv, k + extra, d]`` block; the ``extra`` slots after them are left for new entries."""
        s = self.shape
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
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New entries ``k, v [n, H_kv, d]`` into the pending slots of ``layer``."""
        n = k.shape[0]
        self.kv[layer, 0, :, self.length:self.length + n] = k.transpose(0, 1)
        self.kv[layer, 1, :, self.length:self.length + n] = v.transpose(0, 1)

    def window_start(self, sliding: bool, step: Step) -> int:
        """First slot a sliding layer needs (0 elsewhere, or once slots no longer equal positions)."""
        return sliding_start(step, sliding) if self.contiguous else 0

    def mask(self, layer: int, sliding: bool, step: Step, start: int = 0) -> torch.Tensor | None:
        """Additive mask over slots ``start .. length+n-1`` for the folded query rows: ``[g*n, L]``
        (the same for every head) or ``[H_kv, g*n, L]`` (sliding layers after eviction), or None."""
        if self.contiguous or not (sliding and step.window is not None):
            return contiguous_mask(step, self.length, start, sliding and self.contiguous, self.shape.group,
                                   self.dtype)
        n, a = step.n, self.length
        vis = visibility(a, step.positions, step.new_mask, None, start)[0]  # [n, L] or None
        window = in_window(self.pos[layer, :, start:a + n], step.positions, step.window)  # [H_kv, n, L]
        vis = window if vis is None else vis & window
        if n == 1 and bool(vis.all()):
            return None
        return grouped(vis, self.shape.group, self.dtype)

    def attend_all(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   step: Step) -> torch.Tensor:
        """Write the new entries and attend over every held slot (a sliding layer over its window)."""
        self.write(layer, k, v)
        end = self.length + step.n
        start = self.window_start(sliding, step)
        mask = self.mask(layer, sliding, step, start)
        return step.decoder.attend(q, self.kv[layer, 0, :, start:end], self.kv[layer, 1, :, start:end], mask)

    def attend_block(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: torch.Tensor,
                     step: Step) -> torch.Tensor:
        """Sparse read (TidalDecode, Quest): write the new entries ``k, v [n, H_kv, d]`` into the cache
        and after the ``c`` cached entries already in ``block [2, H_kv, c + n, d]``; attend over the block."""
        n = step.n
        self.write(layer, k, v)
        c = block.shape[2] - n
        block[0, :, c:] = k.transpose(0, 1)
        block[1, :, c:] = v.transpose(0, 1)
        mask = grouped(visibility(c, step.positions, step.new_mask, None)[0], self.shape.group, self.dtype)
        return step.decoder.attend(q, block[0], block[1], mask)
