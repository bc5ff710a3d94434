"""One forward for several sequences: the rows of all their trees stacked, attention per sequence.

Each sequence ``j`` brings ``n_j`` new rows (its root and draft tree, or a single root when it
does not speculate) and its cache slot ``s_j`` of a :class:`~speculum.cache.SlotPool`, holding
``L_j`` committed entries. The ``N = sum n_j`` rows run through every matrix product at once
(``[N, D]``: what costs the same for 16 rows as for one on a CPU); attention runs once per layer
over the pool's slots ``lo .. hi``, as a batch:

- queries are scattered to a padded ``[B, R]`` grid (``B = hi - lo + 1`` slots, ``R = max n_j``)
  and folded per KV head: ``[B, H_kv, g*R, d]``;
- keys and values are the pool's own slots, a view ``[B, H_kv, K, d]`` with ``K = max(L_j + n_j)``;
- the additive mask ``[B, 1, g*R, K]`` gives each row its sequence's visibility (cached entries,
  its tree's ancestors, the sliding window); padding rows, and slots in the range that take no
  part in this step, see key 0 only (a finite row, dropped afterwards).

New keys and values are written into each sequence's slot at ``L_j .. L_j + n_j - 1`` by one
indexed copy per layer. Example: two sequences with ``n = [1, 3]`` after ``L = [10, 4]`` cached
entries: ``N = 4`` rows in the products, ``R = 3``, ``K = 11``; sequence 0's row sees keys
``0..10``, sequence 1's rows see ``0..3`` plus their tree ancestors among ``4..6``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention import Step, folded_attention, use_math_attention, visibility
from ..cache import SlotCache
from .base import Forward
from .decoder import NativeDecoder
from .invariance import NO_FLOORS, RowFloors


@dataclass
class BatchRows:
    """Where each of the ``N`` stacked rows belongs."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] rotary positions
    slots: torch.Tensor  # [N] pool slot of the row's sequence
    writes: torch.Tensor  # [N] cache slot index its entry is written to
    grid: torch.Tensor  # [N] index into the padded [B * R] query grid
    dense: bool  # grid == arange(B * R): the rows fill the grid in order (no scatter needed)
    counts: list[int]  # [J] rows per sequence
    lo: int  # first pool slot of the batch
    batch: int  # B: slots lo .. lo + B - 1
    rows: int  # R: padded rows per slot
    keys: int  # K: key slots attended
    masks: dict[bool, torch.Tensor]  # {sliding: [B, 1, g*R, K] additive}


def stack_rows(caches: Sequence[SlotCache], ids: Sequence[list[int]], steps: Sequence[Step],
               group: int, window: int | None, dtype: torch.dtype, device: torch.device) -> BatchRows:
    """Lay out ``J`` sequences' new rows (``ids[j]`` at ``steps[j]``, after ``caches[j].length``
    cached entries) for :func:`batched_forward`."""
    slots = [c.slot for c in caches]
    lo, hi = min(slots), max(slots)
    b, r = hi - lo + 1, max(len(x) for x in ids)
    keys = max(c.length + len(x) for c, x in zip(caches, ids))
    full = torch.zeros(b, r, keys, dtype=torch.bool, device=device)
    full[:, :, 0] = True  # padding rows and idle slots: key 0 only
    sliding = full.clone() if window is not None else full
    grid, writes, row_slots = [], [], []
    for c, x, step in zip(caches, ids, steps):
        n, length, j = len(x), c.length, c.slot - lo
        f, s = visibility(length, step.positions, step.new_mask, window)
        width = length + n
        full[j, :n, :width] = True if f is None else f
        if sliding is not full:
            sliding[j, :n, :width] = True if s is None else s
        grid.extend(range(j * r, j * r + n))
        writes.extend(range(length, width))
        row_slots.extend([c.slot] * n)

    def additive(m: torch.Tensor) -> torch.Tensor:
        add = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, float("-inf"))
        return add[:, None].expand(b, group, r, keys).reshape(b, 1, group * r, keys)

    masks = {False: additive(full)}
    masks[True] = masks[False] if sliding is full else additive(sliding)
    as_tensor = lambda v: torch.tensor(v, device=device)
    return BatchRows(as_tensor([t for x in ids for t in x]), torch.cat([s.positions for s in steps]),
                     as_tensor(row_slots), as_tensor(writes), as_tensor(grid), grid == list(range(b * r)), [len(x) for x in ids],
                     lo, b, r, keys, masks)


def batched_forward(decoder: NativeDecoder, pool_kv: torch.Tensor, rows: BatchRows,
                    floors: RowFloors | None = None) -> list[Forward]:
    """Logits for every sequence's rows; their keys and values are written into ``pool_kv``
    ``[layers, 2, S, H_kv, C, d]`` (pending). ``floors``: the reproducible mode's row floors
    (:mod:`speculum.runners.invariance`); attention then takes its explicit path.

    Returns one :class:`Forward` per sequence, logits ``[n_j, V]``.
    """
    s = decoder.shape
    b, r, g, d = rows.batch, rows.rows, s.group, s.head_dim
    dense = rows.dense
    math = floors is not None or use_math_attention(g * r, pool_kv.device)
    lo = rows.lo

    def attend(i: int, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = pool_kv[i]  # [2, S, H_kv, C, d]
        kv[0][rows.slots, :, rows.writes] = k  # [N, H_kv, d] into each row's slot and index
        kv[1][rows.slots, :, rows.writes] = v
        if dense:
            qg = q
        else:
            qg = q.new_zeros(b * r, s.heads, d).index_copy_(0, rows.grid, q)
        qg = qg.view(b, r, s.kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b, s.kv_heads, g * r, d)
        keys, values = kv[0, lo:lo + b, :, :rows.keys], kv[1, lo:lo + b, :, :rows.keys]
        out = folded_attention(qg, keys, values, rows.masks[layer.sliding], s.attn_scale, math, s.attn_softcap)
        out = out.view(b, s.kv_heads, g, r, d).permute(0, 3, 1, 2, 4).reshape(b * r, s.heads * d)
        return out if dense else out.index_select(0, rows.grid)

    out = decoder.forward_with(rows.ids, rows.positions, attend, False, (), floors or NO_FLOORS)
    return [Forward(part) for part in out.logits.split(rows.counts)]
