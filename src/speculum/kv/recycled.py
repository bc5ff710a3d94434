"""``recycled``: Recycled Attention (Xu et al., 2024, "Recycled Attention: Efficient inference for
long-context language models"). Every ``stride`` steps a step attends to the whole context, and
its attention (per KV head, summed over the head's queries) picks the ``k`` most attended tokens;
the steps in between attend only to those ``k`` (the *recycled* selection) and to the tokens
generated since that full step.

"Every ``stride`` steps" is counted by position, so that it does not depend on how tokens are
grouped into steps: the token at position ``P`` attends fully when ``(P - A) % stride == 0``,
``A`` being the first position decoded (the token after the prompt, whose step is a full one),
and otherwise recycles the selection of position ``F = P - (P - A) % stride``. Under speculation
each query row of a tree step does exactly that (:mod:`speculum.kv.rows`): a row at a full
position attends over its whole context and picks its top-k, and a deeper row at the same
stride recycles that pick; a row whose ``F`` was committed earlier recycles the committed pick.
The pick of the last kept full row is committed.

Example: ``A = 100``, ``stride = 4``, ``k = 8``: the token at 100 attends to all 100 tokens
before it and picks 8 of them; those at 101, 102, 103 read the 8 and the tokens from 100 on;
the token at 104 attends fully again and picks anew.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import attention_probs, grouped
from .rows import RowSparsePolicy, RowView, kept_rows, top_visible
from .sparse import SparseState


@dataclass
class PendingPicks:
    """One layer's picks during a step, until the commit keeps the last kept full row's."""

    full: list[int]  # rows at full positions
    picked: torch.Tensor | None  # [H_kv, f, L+n] bool columns each full row picked (None: all of its context)
    col_pos: torch.Tensor  # [L+n] the position of each column


@dataclass
class RecycledState(SparseState):
    """One request's recycled selections."""

    start: int = 0  # A: the first position decoded
    picked: dict[int, torch.Tensor | None] = field(default_factory=dict)  # layer -> [H_kv, k] positions (None: all)
    picked_at: dict[int, int] = field(default_factory=dict)  # layer -> the full position that picked them
    pending: dict[int, PendingPicks] = field(default_factory=dict)


class RecycledPolicy(RowSparsePolicy):
    """Full attention every ``stride`` positions, its top-k recycled in between.

    Options: ``stride`` (10: the paper's main setting), ``dense``: leading layers that attend
    densely (2, as the other sparse-read policies: speculum's convention, not the paper's).
    """

    name = "recycled"

    def __init__(self, budget="0.25", stride: int = 10, dense: int = 2):
        super().__init__(budget)
        self.stride, self.dense_layers = int(stride), int(dense)
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, got {self.stride}")
        if self.dense_layers < 0:
            raise ValueError("dense must be non-negative")

    def new_state(self, cache, read):
        return RecycledState(read)

    def end_prefill(self, cache, n):
        super().end_prefill(cache, n)
        cache.state.start = n

    def anchors(self, st: RecycledState, rows: RowView) -> torch.Tensor:
        """``[n]``: the full position each row recycles (its own where it is one)."""
        return rows.positions - (rows.positions - st.start) % self.stride

    def covers(self, st, rows):
        return int(self.anchors(st, rows).max()) <= st.read

    def dense_step(self, cache, layer, q, rows):
        st = cache.state
        full = (self.anchors(st, rows) == rows.positions).nonzero()[:, 0].tolist()
        st.pending[layer] = PendingPicks(full, None, rows.col_pos)

    def select(self, cache, layer, q, k, rows: RowView):
        st, s = cache.state, cache.layout
        L, n, C = rows.length, rows.n, rows.columns
        anchor = self.anchors(st, rows)  # [n]
        full = (anchor == rows.positions).nonzero()[:, 0]
        visible = torch.zeros((s.kv_heads, n, C), dtype=torch.bool, device=q.device)
        picked = None
        if full.numel():
            ctx = rows.context[full]  # [f, L+n]
            seen = ctx.clone()
            seen[torch.arange(full.numel()), L + full] = True  # the full step's attention includes the row itself
            probs = attention_probs(q[full], cache.kv[layer, 0, :, :C], grouped(seen, s.group, torch.float32),
                                    s.scale, s.softcap)  # [H_kv, g*f, L+n]
            picked = top_visible(probs.view(s.kv_heads, s.group, full.numel(), C).sum(1), ctx, st.read)
            visible[:, full] = ctx
        recycled = self.recycled(st, layer, s.kv_heads, rows, anchor, full, picked)  # [H_kv, n, L+n]
        rest = anchor != rows.positions
        visible[:, rest] = recycled[:, rest] | rows.between(anchor, rows.positions)[rest]
        st.pending[layer] = PendingPicks(full.tolist(), picked, rows.col_pos)
        return visible

    def recycled(self, st: RecycledState, layer: int, heads: int, rows: RowView, anchor: torch.Tensor,
                 full: torch.Tensor, picked: torch.Tensor | None) -> torch.Tensor:
        """``[H_kv, n, L+n]``: the pick each row recycles (rows at full positions: their own)."""
        L, n = rows.length, rows.n
        out = torch.zeros((heads, n, rows.columns), dtype=torch.bool, device=rows.positions.device)
        old = anchor < L
        if bool(old.any()):
            if st.picked_at.get(layer) != int(anchor[old][0]):
                raise RuntimeError("recycled attention: no committed pick for this stride")
            if st.picked[layer] is None:
                out[:, old] = rows.context[old] & (rows.col_pos < int(anchor[old][0]))
            else:
                committed = torch.zeros((heads, rows.columns), dtype=torch.bool, device=out.device)
                committed.scatter_(1, st.picked[layer], True)
                out[:, old] = committed[:, None]
        new = (~old).nonzero()[:, 0]
        if new.numel():  # the full row among the step's rows: the ancestor (or self) at the anchor's position
            owner = rows.context[new, L:] | (torch.arange(n, device=out.device)[None, :] == new[:, None])
            owner &= rows.positions[None, :] == anchor[new, None]  # [r, n]
            slot = torch.full((n,), -1, dtype=torch.long, device=out.device)
            slot[full] = torch.arange(full.numel(), device=out.device)
            out[:, new] = picked[:, slot[owner.float().argmax(1)]]
        return out

    def before_commit(self, cache, keep) -> None:
        st = cache.state
        for layer, p in st.pending.items():
            kept = kept_rows(keep, p.col_pos.shape[0] - cache.length)
            last = [i for i in kept if i in p.full]
            if not last:
                continue
            j = max(last, key=lambda i: int(p.col_pos[cache.length + i]))
            st.picked_at[layer] = int(p.col_pos[cache.length + j])
            if p.picked is None:
                st.picked[layer] = None
            else:
                f = p.full.index(j)
                cols = p.picked[:, f]  # [H_kv, L+n], the same count per head
                st.picked[layer] = p.col_pos.expand(cols.shape[0], -1)[cols].view(cols.shape[0], -1)
        st.pending.clear()
