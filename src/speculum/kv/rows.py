"""Per-row sparse reads: what the decode-time selection policies (Double Sparsity, TokenSelect,
Squeezed Attention, Recycled Attention, HiP) share, so that a step of several query rows (a
verification tree, a chain) reads, for each row, what a one-token step at that row's position
would read.

A step feeds ``n`` new tokens after ``L`` committed ones (these policies never evict, so slot ``c``
holds position ``c``); the new entries are written first, so they sit at slots ``L .. L+n-1`` and
a step's *columns* are its slots ``0 .. L+n-1``. Row ``i`` sits at position ``P_i``. A one-token
step at ``P_i`` would find committed the ``P_i`` tokens before it: the ``L`` committed ones and the
row's strict ancestors in the tree (positions ``L .. P_i-1``). Those are the row's *context*,
``[n, L+n]`` bool over the columns (:class:`RowView`).

A policy chooses, per row (and per KV head), a subset of the row's context from that row's query
and the context's keys alone (:meth:`RowSparsePolicy.select`); the step reads the union of the
rows' choices once and masks each row to its own choice plus itself
(:func:`read_rows`, through :meth:`~speculum.cache.PositionedKVCache.attend_rows`). A token's
output then does not depend on how tokens were grouped into steps (up to floating-point summation
order), and speculation under these policies gives what plain decoding under them gives. Policies
with state across steps (TokenSelect's Selection Cache, Recycled Attention's recycled top-k) keep
it per row during a step and commit the last kept row's (:meth:`RowSparsePolicy.before_commit`).

Example: ``L = 4`` committed, a root ``r`` (position 4) with two children ``a``, ``b`` (position
5)::

    columns     0 1 2 3 | r a b
    context r   1 1 1 1 | 0 0 0     # as a one-token step at 4: slots 0..3
    context a   1 1 1 1 | 1 0 0     # at 5: slots 0..3 and r
    context b   1 1 1 1 | 1 0 0

With a top-2 rule, ``r`` might choose {1, 3}, ``a`` {0, r} and ``b`` {3, r}: the step reads slots
{0, 1, 3} and the new entries, row ``a`` masked to {0, r, a}.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..attention import Step
from ..cache import PositionedKVCache
from ..cache.row_kernels import row_kernels_for
from .sparse import SparseReadPolicy, SparseState


@dataclass
class RowView:
    """One step's query rows, each seen as a one-token step at its own position would see the cache."""

    length: int  # L committed slots
    positions: torch.Tensor  # [n] each row's position (L + its depth in the tree)
    context: torch.Tensor  # [n, L + n] bool: the committed slots and the row's strict ancestors
    col_pos: torch.Tensor  # [L + n] the position each column holds

    @classmethod
    def of(cls, length: int, step: Step) -> RowView:
        """The view of ``step``'s rows after ``length`` committed slots: made once per step (it depends on
        nothing else) and shared by every layer of the forward. Its tensors are read, never written."""
        key = (cls, length)
        view = step.memo.get(key)
        if view is None:
            view = step.memo[key] = cls.make(length, step)
        return view

    @classmethod
    def make(cls, length: int, step: Step) -> RowView:
        n, dev = step.n, step.positions.device
        if step.new_mask is None:
            ancestors = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)
        else:
            ancestors = step.new_mask.to(dev, torch.bool).clone()
            ancestors.fill_diagonal_(False)
        context = torch.cat([torch.ones(n, length, dtype=torch.bool, device=dev), ancestors], dim=1)
        col_pos = torch.cat([torch.arange(length, device=dev), step.positions])
        return cls(length, step.positions, context, col_pos)

    @property
    def n(self) -> int:
        return self.positions.shape[0]

    @property
    def columns(self) -> int:
        return self.length + self.n

    def between(self, lo: torch.Tensor | int, hi: torch.Tensor | int) -> torch.Tensor:
        """``[n, L+n]``: each row's context at positions ``lo <= p < hi`` (ints or per-row ``[n]``)."""
        lo = lo[:, None] if isinstance(lo, torch.Tensor) else lo
        hi = hi[:, None] if isinstance(hi, torch.Tensor) else hi
        return self.context & (self.col_pos >= lo) & (self.col_pos < hi)

    def always(self, sinks: int, window: int) -> torch.Tensor:
        """``[n, L+n]``: the first ``sinks`` positions and the ``window`` positions before each row (made
        once per view and pair)."""
        memo = self.__dict__.setdefault("_always", {})
        if (sinks, window) not in memo:
            memo[sinks, window] = self.between(0, sinks) | self.between(self.positions - window, self.positions)
        return memo[sinks, window]

    def ancestor_columns(self) -> torch.Tensor:
        """``[n, D]``: for row ``i`` and ``t < depth_i``, the column of its ancestor at position ``L + t``
        (0 elsewhere)."""
        n, L = self.n, self.length
        depth = int(self.positions.max()) - L + 1
        out = torch.zeros(n, max(depth, 1), dtype=torch.long, device=self.positions.device)
        rows, cols = self.context[:, L:].nonzero(as_tuple=True)  # row i, its ancestor j
        out[rows, self.positions[cols] - L] = L + cols
        return out

    def columns_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions ``pos [..., n, m]`` in each row's context -> their columns (same shape)."""
        L = self.length
        if int(pos.max()) < L:
            return pos
        anc = self.ancestor_columns()  # [n, D]
        deep = (pos - L).clamp(0, anc.shape[1] - 1)
        return torch.where(pos < L, pos, anc.expand(*pos.shape[:-1], -1).gather(-1, deep))

    @cached_property
    def position_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's context in position order: ``cols [n, P]`` the column holding position ``p`` for
        row ``i`` (``P`` = the deepest row's position; the dummy column ``L+n`` where ``p`` is not in the
        row's context, i.e. ``p >= P_i``) and ``inside [n, P]`` bool, ``p < P_i``."""
        n, dev = self.n, self.positions.device
        P = int(self.positions.max())
        pos = torch.arange(P, device=dev).expand(n, P)
        inside = pos < self.positions[:, None]
        cols = self.columns_of(pos) if P else pos
        return cols.masked_fill(~inside, self.columns), inside

    def by_position(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``scores [H, n, L+n]`` over columns -> ``[H, n, P]`` over each row's context in position order
        (0 past the row's position), as a one-token step at the row's position holds them in its slots,
        and ``inside [n, P]`` (:attr:`position_columns`)."""
        cols, inside = self.position_columns
        padded = torch.cat([scores, scores.new_zeros(*scores.shape[:-1], 1)], dim=-1)
        return padded.gather(-1, cols.expand(scores.shape[0], -1, -1)), inside

    def to_columns(self, chosen: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`by_position` for a choice: bool ``[H, n, P]`` over positions ->
        ``[H, n, L+n]`` over columns."""
        cols, _ = self.position_columns
        out = torch.zeros(*chosen.shape[:-1], self.columns + 1, dtype=torch.int8, device=chosen.device)
        out.scatter_add_(-1, cols.expand(chosen.shape[0], -1, -1), chosen.to(torch.int8))
        return out[..., : self.columns] > 0


def top_visible(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best candidates per row: ``scores [..., n, C]`` float, ``candidates`` bool broadcastable
    to it -> bool ``[..., n, C]`` (every candidate where a row has ``k`` or fewer). Ties go to the lower
    index where the row kernels run (``row_topk``: one pass per row), torch's way elsewhere."""
    ops = row_kernels_for(scores)
    if ops is not None and scores.dim() >= 2:
        return kernel_top(ops, scores, candidates, k)
    s = scores.masked_fill(~candidates, float("-inf"))
    idx = s.topk(min(k, s.shape[-1]), dim=-1).indices
    return torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(-1, idx, True) & candidates


def top_stable(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_visible` with ties broken towards the lower index (a stable sort), so that a row's
    choice does not depend on how long the vector around it is (max-pooled scores have plateaus)."""
    ops = row_kernels_for(scores)
    if ops is not None and scores.dim() >= 2:
        return kernel_top(ops, scores, candidates, k)
    s = scores.masked_fill(~candidates, float("-inf"))
    idx = s.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, s.shape[-1])]
    return torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(-1, idx, True) & candidates


def kernel_top(ops, scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """``row_topk`` over ``scores [..., n, C]`` folded to ``[B, n, C]`` (candidates ``[n, C]`` shared by
    every ``B``, or broadcast to the scores' shape)."""
    n, C = scores.shape[-2:]
    s = scores.reshape(-1, n, C).float().contiguous()
    cand = candidates.to(torch.bool)
    if cand.dim() < 3 or cand.shape[:-2].numel() == 1:
        cand = cand.reshape(cand.shape[-2:] if cand.dim() >= 2 else cand.shape).expand(n, C)[None]
    else:
        cand = cand.expand(scores.shape).reshape(-1, n, C)
    return ops.row_topk(s, cand.contiguous(), int(k)).view(scores.shape)


def masked_softmax(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores [..., C]`` over ``candidates`` (0 elsewhere, and on rows without any)."""
    return scores.masked_fill(~candidates, float("-inf")).softmax(-1).nan_to_num_(0.0)


def row_reads(visible: torch.Tensor, rows: RowView, heads: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """What :func:`read_rows` reads for the choice ``visible [H_kv or 1, n, L+n]``: the committed slots
    ``[H_kv, m]`` (each head's chosen slots first, increasing, padded with unchosen ones that every row
    masks; None: all of them) and the mask ``[H_kv, n, m + n]`` over those and the new entries, each row
    seeing its choice and itself. A policy whose choice holds for several layers computes it once."""
    L, n = rows.length, rows.n
    ops = row_kernels_for(visible)
    if ops is not None:
        slots, mask, in_place = ops.row_reads(visible.to(torch.bool).contiguous(), L, heads)
        return (None if in_place else slots), mask
    vis = visible.expand(heads, n, rows.columns).clone()
    idx = torch.arange(n, device=vis.device)
    vis[:, idx, L + idx] = True  # the row itself
    used = vis[:, :, :L].any(1)  # [H_kv, L]
    m = int(used.sum(1).max()) if L else 0
    if m == L:  # everything committed is read by some row: in place
        return None, vis
    slots = used.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :m].sort(dim=1).values
    mask = torch.cat([vis[:, :, :L].gather(2, slots[:, None, :].expand(heads, n, m)), vis[:, :, L:]], dim=2)
    return slots, mask


def read_rows(cache: PositionedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              visible: torch.Tensor | tuple, rows: RowView, step: Step) -> torch.Tensor:
    """Attend each row over its chosen columns ``visible [H_kv or 1, n, L+n]`` (or their
    :func:`row_reads`) and itself: the union of the rows' committed slots is read once, each row masked
    to its own choice -> ``[n, H*d]``."""
    slots, mask = visible if isinstance(visible, tuple) else row_reads(visible, rows, cache.layout.kv_heads)
    return cache.attend_rows(layer, q, k, v, slots, mask, step)


class RowSparseCache(PositionedKVCache):
    """A positioned cache whose byte count includes what its policy keeps beside the entries (Double
    Sparsity's label cache, Squeezed Attention's centroids): the state's ``side_bytes()``, if any."""

    def nbytes(self) -> int:
        side = getattr(self.state, "side_bytes", None)
        return super().nbytes() + (side() if side is not None else 0)


class RowSparsePolicy(SparseReadPolicy):
    """Full storage, sparse reads chosen per query row: subclasses implement :meth:`select` and
    :meth:`covers` (and may keep per-step state, committed in :meth:`before_commit`)."""

    def new_cache(self, layout, dtype, device, capacity: int) -> RowSparseCache:
        return RowSparseCache(layout, dtype, device, capacity)

    def dense(self, cache, layer: int, sliding: bool) -> bool:
        """The first ``dense_layers`` layers and sliding-window layers always read everything (whether
        the budget covers the context is a per-row question here: :meth:`covers`)."""
        return sliding or layer < self.dense_layers

    def covers(self, st: SparseState, rows: RowView) -> bool:
        """True when every row would choose its whole context (the step then reads everything)."""
        return int(rows.positions.max()) <= st.read

    def select(self, cache: PositionedKVCache, layer: int, q: torch.Tensor, k: torch.Tensor,
               rows: RowView) -> torch.Tensor:
        """Each row's choice among its context: ``[H_kv or 1, n, L+n]`` bool (the row itself is added)."""
        raise NotImplementedError

    def dense_step(self, cache: PositionedKVCache, layer: int, q: torch.Tensor, rows: RowView) -> None:
        """A sparse layer's step that :meth:`covers`: stateful policies note what its rows chose."""

    def attend(self, cache, layer, sliding, q, k, v, step):
        if self.dense(cache, layer, sliding):
            return cache.attend_all(layer, sliding, q, k, v, step)
        rows = RowView.of(cache.length, step)
        if self.covers(cache.state, rows):
            self.dense_step(cache, layer, q, rows)
            return cache.attend_all(layer, sliding, q, k, v, step)
        cache.write(layer, k, v)  # the new entries at slots L .. L+n-1: every column is a slot
        return read_rows(cache, layer, q, k, v, self.select(cache, layer, q, k, rows), rows, step)


def kept_rows(keep: list[int] | None, n: int) -> list[int]:
    """The pending indices a commit keeps (``keep`` None: all ``n``)."""
    return list(range(n)) if keep is None else list(keep)
