"""One forward for several sequences: the rows of all their trees (and prefill chunks) stacked,
attention per sequence.

Each sequence ``j`` brings ``n_j`` new rows (its root and draft tree, a single root when it does not
speculate, or a chunk of its prompt) and its cache slot ``s_j`` of a
:class:`~speculum.cache.SlotPool`, holding ``L_j`` committed entries. The ``N = sum n_j`` rows run
through every matrix product at once (``[N, D]``: what costs the same for 16 rows as for one on a
CPU). Attention runs per *group* of sequences, each group as one batch over the pool's slots
``lo .. hi`` it spans:

- queries are scattered to a padded ``[B, R]`` grid (``B = hi - lo + 1`` slots, ``R = max n_j`` in
  the group) and folded per KV head: ``[B, H_kv, g*R, d]``;
- keys and values are the pool's own slots, a view ``[B, H_kv, K, d]`` with ``K = max(L_j + n_j)``;
- the additive mask ``[B, 1, g*R, K]`` gives each row its sequence's visibility (cached entries,
  its tree's ancestors or causal order, the sliding window); padding rows, and slots in the range
  that take no part, see key 0 only (a finite row, dropped afterwards).

Decoding sequences with at most :data:`SMALL_ROWS` rows share groups, cut into runs of neighbouring
slots where a short sequence would otherwise read keys up to a long one's length
(:func:`split_by_length`); a prompt chunk, or a larger tree, gets its own group, so that nobody's
queries are padded to a chunk's length (and a chunk's attention runs on the kernel its prefill
alone would use). Logits are
computed only for the rows that need them: every row of a tree, the last row of a prefill chunk.

Example: two sequences with ``n = [1, 3]`` after ``L = [10, 4]`` cached entries: ``N = 4`` rows in
the products, one group with ``R = 3``, ``K = 11``; sequence 0's row sees keys ``0..10``, sequence
1's rows see ``0..3`` plus their tree ancestors among ``4..6``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention import Step, folded_attention, grouped, use_math_attention, visibility
from ..cache import SlotCache
from ..cache.store import StoreBase, put_rows
from .base import Forward
from .decoder import NativeDecoder
from .invariance import NO_FLOORS, RowFloors

SMALL_ROWS = 16  # sequences with at most this many rows share one attention group
# what one more attention call costs, in key slots read (a call's overhead against reading one
# cached entry of one sequence): decides where one group is split into slot ranges
CALL_COST_KEYS = 400


def split_by_length(slots: list[int], keys: list[int], call_cost: int = CALL_COST_KEYS) -> list[list[int]]:
    """Cut sequences (indices into ``slots [J]`` and ``keys [J]``, their pool slots and key counts)
    into runs of neighbouring slots, each one attention call over its slot range padded to its
    longest sequence, minimising ``sum(call_cost + slots spanned * longest keys)``. One call over
    everything reads every slot up to the longest sequence's length; a short sequence beside a long
    one is cheaper in a call of its own.

    Example: slots ``[0, 1, 2]`` with keys ``[1500, 60, 80]`` -> ``[[0], [1, 2]]`` (reads 1500 + 160
    slots' keys instead of 4500)."""
    order = sorted(range(len(slots)), key=lambda j: slots[j])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of the first i sequences (in slot order)
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        longest = 0
        for a in range(i, 0, -1):  # the last run is order[a-1 .. i-1]
            longest = max(longest, keys[order[a - 1]])
            span = slots[order[i - 1]] - slots[order[a - 1]] + 1
            cost = best[a - 1] + call_cost + span * longest
            if cost < best[i]:
                best[i], cut[i] = cost, a - 1
    runs, i = [], n
    while i > 0:
        runs.append(order[cut[i]:i])
        i = cut[i]
    return runs[::-1]


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one batch."""

    rows: torch.Tensor | None  # [N_g] which of the N stacked rows are the group's (None: all, in order)
    grid: torch.Tensor  # [N_g] index into the padded [B * R] query grid
    dense: bool  # grid == arange(B * R): no scatter needed
    lo: int  # first pool slot
    batch: int  # B: slots lo .. lo + B - 1
    width: int  # R: padded rows per slot
    keys: int  # K: key slots attended
    masks: dict[bool, torch.Tensor]  # {sliding: [B, 1, g*R, K] additive}
    prefill: bool = False  # a prompt chunk: attention by the kernel a prefill uses alone


@dataclass
class BatchRows:
    """Where each of the ``N`` stacked rows belongs."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] rotary positions
    slots: torch.Tensor  # [N] pool slot of the row's sequence
    writes: torch.Tensor  # [N] cache slot index its entry is written to
    groups: list[AttentionGroup]
    logit_rows: torch.Tensor | None  # [M] rows whose logits are computed (None: all N)
    logit_counts: list[int]  # [J] logit rows per sequence
    counts: list[int]  # [J] rows per sequence


def _group(caches: Sequence[SlotCache], ids: Sequence[list[int]], steps: Sequence[Step], starts: list[int],
           members: list[int], n_total: int, group: int, window: int | None, dtype: torch.dtype,
           device: torch.device) -> AttentionGroup:
    """The attention group of sequences ``members`` (their rows start at ``starts[j]``)."""
    slots = [caches[j].slot for j in members]
    lo, hi = min(slots), max(slots)
    b, r = hi - lo + 1, max(len(ids[j]) for j in members)
    keys = max(caches[j].length + len(ids[j]) for j in members)
    full = torch.zeros(b, r, keys, dtype=torch.bool, device=device)
    full[:, :, 0] = True  # padding rows and idle slots: key 0 only
    sliding = full.clone() if window is not None else full
    grid, rows = [], []
    for j in members:
        c, n = caches[j], len(ids[j])
        at, width = c.slot - lo, c.length + n
        f, s = visibility(c.length, steps[j].positions, steps[j].new_mask, window)
        full[at, :n, :width] = True if f is None else f
        if sliding is not full:
            sliding[at, :n, :width] = True if s is None else s
        grid.extend(range(at * r, at * r + n))
        rows.extend(range(starts[j], starts[j] + n))

    masks = {False: grouped(full, group, dtype)[:, None]}  # [B, 1, g*R, K]
    masks[True] = masks[False] if sliding is full else grouped(sliding, group, dtype)[:, None]
    all_rows = rows == list(range(n_total))
    return AttentionGroup(None if all_rows else torch.tensor(rows, device=device), torch.tensor(grid, device=device),
                          grid == list(range(b * r)), lo, b, r, keys, masks)


def stack_rows(caches: Sequence[SlotCache], ids: Sequence[list[int]], steps: Sequence[Step],
               group: int, window: int | None, dtype: torch.dtype, device: torch.device,
               last_only: Sequence[bool] | None = None) -> BatchRows:
    """Lay out ``J`` sequences' new rows (``ids[j]`` at ``steps[j]``, after ``caches[j].length``
    cached entries) for :func:`batched_forward`. ``last_only[j]``: sequence ``j`` needs the logits
    of its last row only (a prefill chunk)."""
    last_only = list(last_only or [False] * len(ids))
    counts = [len(x) for x in ids]
    starts = [sum(counts[:j]) for j in range(len(ids))]
    n = sum(counts)
    small = [j for j in range(len(ids)) if counts[j] <= SMALL_ROWS and not last_only[j]]
    runs = split_by_length([caches[j].slot for j in small], [caches[j].length + counts[j] for j in small])
    parts = [[small[i] for i in run] for run in runs] + [[j] for j in range(len(ids)) if j not in small]
    groups = [_group(caches, ids, steps, starts, m, n, group, window, dtype, device) for m in parts]
    for grp, m in zip(groups, parts):
        grp.prefill = last_only[m[0]]
    logit_rows = None
    if any(last_only):
        logit_rows = torch.tensor([i for j in range(len(ids)) for i in
                                   ([starts[j] + counts[j] - 1] if last_only[j] else range(starts[j], starts[j] + counts[j]))],
                                  device=device)
    rows_of = lambda v: torch.tensor(v, device=device)
    return BatchRows(rows_of([t for x in ids for t in x]), torch.cat([s.positions for s in steps]),
                     rows_of([c.slot for c, k in zip(caches, counts) for _ in range(k)]),
                     rows_of([c.length + i for c, k in zip(caches, counts) for i in range(k)]), groups, logit_rows,
                     [1 if lo_ else k for lo_, k in zip(last_only, counts)], counts)


def batched_forward(decoder: NativeDecoder, pool_kv: torch.Tensor, rows: BatchRows,
                    floors: RowFloors | None = None, hidden_layers: Sequence[int] = ()) -> list[Forward]:
    """Logits for every sequence's rows (its last row only where it asked for that); their keys and
    values are written into ``pool_kv`` ``[layers, 2, S, H_kv, C, d]`` (pending). ``floors``: the
    reproducible mode's row floors (:mod:`speculum.runners.invariance`); decoding groups then take
    the explicit attention path.

    Returns one :class:`Forward` per sequence, logits ``[n_j, V]`` (``[1, V]`` for a last-only one)
    and, for ``hidden_layers``, hidden states ``[n_j, D]`` of every row.
    """
    out = decoder.forward_with(rows.ids, rows.positions, PoolStore(decoder, pool_kv, rows, floors is not None),
                               False, hidden_layers, floors or NO_FLOORS, logit_rows=rows.logit_rows)
    hidden = {i: h.split(rows.counts) for i, h in out.hidden.items()}
    return [Forward(part, {i: hs[j] for i, hs in hidden.items()})
            for j, part in enumerate(out.logits.split(rows.logit_counts))]


class PoolStore(StoreBase):
    """A batched forward's :class:`~speculum.cache.store.KVStore`: each row's entry goes to its
    sequence's pool slot, and attention runs per group (:class:`AttentionGroup`) over the slots it
    spans. ``explicit``: decoding groups take the explicit attention path (the reproducible mode)."""

    def __init__(self, decoder: NativeDecoder, pool_kv: torch.Tensor, rows: BatchRows, explicit: bool):
        self.shape, self.pool_kv, self.rows, self.explicit = decoder.shape, pool_kv, rows, explicit

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        put_rows(self.pool_kv[layer], self.rows.slots, self.rows.writes, k, v)  # [N, H_kv, d]

    def read(self, layer: int, sliding: bool, q: torch.Tensor) -> torch.Tensor:
        groups = self.rows.groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._group(self.pool_kv[layer], groups[0], q, sliding)
        s = self.shape
        out = q.new_empty(q.shape[0], s.heads * s.head_dim)
        for grp in groups:
            out.index_copy_(0, grp.rows, self._group(self.pool_kv[layer], grp, q.index_select(0, grp.rows), sliding))
        return out

    def _group(self, kv: torch.Tensor, grp: AttentionGroup, q: torch.Tensor, sliding: bool) -> torch.Tensor:
        """One group's attention: ``q [N_g, H, d]`` -> ``[N_g, H*d]`` over ``kv [2, S, H_kv, C, d]``."""
        s = self.shape
        g, d, b, r = s.group, s.head_dim, grp.batch, grp.width
        qg = q if grp.dense else q.new_zeros(b * r, s.heads, d).index_copy_(0, grp.grid, q)
        qg = qg.view(b, r, s.kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, s.kv_heads, g * r, d)
        keys, values = kv[0, grp.lo:grp.lo + b, :, :grp.keys], kv[1, grp.lo:grp.lo + b, :, :grp.keys]
        math = (self.explicit and not grp.prefill) or use_math_attention(g * r, kv.device, grp.keys)
        out = folded_attention(qg, keys, values, grp.masks[sliding], s.attn_scale, math, s.attn_softcap,
                               row_blocks=grp.prefill)
        out = out.view(b, s.kv_heads, g, r, d).permute(0, 3, 1, 2, 4).reshape(b * r, s.heads * d)
        return out if grp.dense else out.index_select(0, grp.grid)
