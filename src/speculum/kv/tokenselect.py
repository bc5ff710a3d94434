"""``tokenselect``: TokenSelect (Wu et al., 2024, "TokenSelect: Efficient Long-Context Inference and
Length Extrapolation for LLMs via Dynamic Token-Level KV Cache Selection"). At every step and
sparse layer, each query head scores every cached token by its query-key dot product; the scores
are softmax-normalised per head and summed over all heads of the layer (*head soft voting*, so
that no single head with large logits decides alone), and the ``k`` tokens with the most votes
are read, the same ones by every head of the layer, with the first ``sinks`` and the last
``window`` tokens always read. The *Selection Cache* skips the scoring: when the query (all heads,
flattened) has cosine similarity at least ``threshold`` with the query whose selection was last
computed, that selection is reused.

Under speculation each query row decides as a one-token step at its position would
(:mod:`speculum.kv.rows`): its own votes over its context, and the Selection Cache followed along
its path: the root compares with the last committed token's anchor (the query of the last
computed selection), a deeper row with its parent's. The anchor of the last kept row is committed.

Example: 3 heads, 20 cached tokens, ``k = 2``, no sinks or window: head 0's softmax puts 0.9 on
token 7, heads 1 and 2 put 0.3 on tokens 7 and 12 and spread the rest; the votes are 1.5 for 7,
0.6 for 12, less elsewhere, and every head reads tokens 7 and 12 (and the new token itself). The
next token's query, at cosine 0.95 with this one, reads 7 and 12 again without scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import attention_scores, fold_queries
from ..cache.kernels import kernels_for, mask3
from .rows import RowSparsePolicy, RowView, kept_rows, masked_softmax, top_visible
from .sparse import SparseState


@dataclass
class Anchor:
    """A computed selection the Selection Cache reuses."""

    query: torch.Tensor  # [H*d] float32 the query that chose it
    positions: torch.Tensor  # [k] the positions chosen


@dataclass
class PendingSelections:
    """One layer's selections during a step, until the commit keeps one row's."""

    anchor_of: list[int | None]  # [n] per row: -1 the committed anchor, j row j's own selection, None none yet
    queries: torch.Tensor  # [n, H*d] float32
    chosen: dict[int, torch.Tensor]  # row j -> [L+n] bool columns it chose (rows that computed one)
    col_pos: torch.Tensor  # [L+n] the position of each column


@dataclass
class TokenSelectState(SparseState):
    """One request's Selection Cache, per sparse layer."""

    anchors: dict[int, Anchor] = field(default_factory=dict)  # layer -> committed anchor
    pending: dict[int, PendingSelections] = field(default_factory=dict)  # layer -> this step's


def parents(rows: RowView) -> list[int]:
    """Each row's parent among the step's rows (its deepest strict ancestor), -1 for the root."""
    anc = rows.context[:, rows.length:]  # [n, n]
    deepest = torch.where(anc, rows.positions[None, :], -1).max(dim=1)
    return torch.where(deepest.values >= 0, deepest.indices, -1).tolist()


class TokenSelectPolicy(RowSparsePolicy):
    """Head-soft-voted token selection with the Selection Cache.

    Options: ``sinks`` (128), ``window`` (512): the first and the most recent tokens, always read,
    and ``threshold`` (0.9): the Selection Cache's cosine similarity, as in the paper's released
    configuration (``threshold=1.01`` turns the cache off); ``dense``: leading layers that attend
    densely (2, as the other sparse-read policies: speculum's convention, not the paper's).
    """

    name = "tokenselect"

    def __init__(self, budget="0.25", sinks: int = 128, window: int = 512, threshold: float = 0.9, dense: int = 2):
        super().__init__(budget)
        self.sinks, self.window, self.dense_layers = int(sinks), int(window), int(dense)
        self.threshold = float(threshold)
        if min(self.sinks, self.window, self.dense_layers) < 0:
            raise ValueError("sinks, window and dense must be non-negative")

    def new_state(self, cache, read):
        return TokenSelectState(read)

    def covers(self, st, rows):
        return int(rows.positions.max()) <= st.read + self.sinks + self.window

    def dense_step(self, cache, layer, q, rows):
        cache.state.pending.pop(layer, None)  # every row reads everything; the anchors stay

    def select(self, cache, layer, q, k, rows: RowView):
        st, C = cache.state, rows.columns
        always = rows.always(self.sinks, self.window)
        candidates = rows.context & ~always  # [n, L+n]
        queries = q.reshape(rows.n, -1).float()
        anchor = st.anchors.get(layer)
        sizes = candidates.sum(1).tolist()
        anchor_of, fresh = self.walk(rows, sizes, queries, anchor, st.read)
        chosen = {}
        if fresh:
            picked = self.vote(cache, layer, q[fresh], candidates[fresh])  # [f, L+n]
            chosen = dict(zip(fresh, picked))
        reused = None
        if anchor is not None:
            reused = torch.zeros(C, dtype=torch.bool, device=q.device)
            reused[anchor.positions] = True
        visible = candidates.clone()  # rows whose candidates fit the budget read them all
        for i, a in enumerate(anchor_of):
            if sizes[i] > st.read:
                visible[i] = reused if a == -1 else chosen[a]
        st.pending[layer] = PendingSelections(anchor_of, queries, chosen, rows.col_pos)
        return (visible | always)[None]

    def walk(self, rows: RowView, sizes: list[int], queries: torch.Tensor,
             anchor: Anchor | None, read: int) -> tuple[list[int | None], list[int]]:
        """Each row's anchor along its path (parents first) and the rows that compute a selection;
        ``sizes [n]``: each row's candidate count (those within ``read`` read all, choosing nothing)."""
        up = parents(rows)
        unit = torch.nn.functional.normalize(queries, dim=1)
        base = None if anchor is None else torch.nn.functional.normalize(anchor.query, dim=0)
        cos_rows = (unit @ unit.T).tolist()  # [n, n]
        cos_base = (unit @ base).tolist() if base is not None else None
        anchor_of: list[int | None] = [None] * rows.n
        fresh = []
        for i in sorted(range(rows.n), key=lambda r: int(rows.positions[r])):
            inherited = anchor_of[up[i]] if up[i] >= 0 else (-1 if anchor is not None else None)
            if sizes[i] <= read:
                anchor_of[i] = inherited  # reads all its candidates: no selection computed
                continue
            if inherited is not None:
                cos = cos_base[i] if inherited == -1 else cos_rows[i][inherited]
                if cos >= self.threshold:
                    anchor_of[i] = inherited
                    continue
            anchor_of[i] = i
            fresh.append(i)
        return anchor_of, sorted(fresh)

    def vote(self, cache, layer: int, q: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Head soft voting for rows ``q [f, H, d]`` over their ``candidates [f, L+n]`` -> ``[f, L+n]`` bool."""
        s = cache.layout
        f, end = q.shape[0], candidates.shape[1]
        ops = kernels_for(q, s.head_dim)
        if ops is not None:  # raw q.k, -inf off the candidates, the keys read in place
            dots = ops.slot_scores(q, cache.kv[layer, 0], None, 0, end, mask3(candidates), 1.0, 0.0)
            votes = dots.softmax(-1).nan_to_num_(0.0).view(s.kv_heads, s.group, f, end).sum((0, 1))  # [f, L+n]
        else:
            keys = cache.kv[layer, 0, :, :end]  # [H_kv, L+n, d], the new entries written
            dots = attention_scores(fold_queries(q, s.kv_heads), keys, None, 1.0)  # [H_kv, g*f, L+n] raw q.k
            votes = masked_softmax(dots.view(s.kv_heads, s.group, f, end), candidates).sum((0, 1))
        return top_visible(votes, candidates, cache.state.read)

    def before_commit(self, cache, keep) -> None:
        st = cache.state
        for layer, p in st.pending.items():
            last = kept_rows(keep, len(p.anchor_of))[-1]
            a = p.anchor_of[last]
            if a is not None and a >= 0:
                st.anchors[layer] = Anchor(p.queries[a], p.col_pos[p.chosen[a]])
        st.pending.clear()
