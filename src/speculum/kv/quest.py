"""``quest``: Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference"). The cache is cut into pages of ``page`` tokens, each summarised by the
channel-wise minimum and maximum of its keys; at each step and layer, every page gets an upper
bound of its attention score, ``sum_c max(q_c min_c, q_c max_c)``, and only the best pages (up
to the budget) are read, plus the last, unfinished page. Unlike TidalDecode every sparse layer
selects for itself, from the bounds, without reading the keys. The chosen pages are read in place
(:meth:`~speculum.cache.PositionedKVCache.attend_rows`), not copied. Where the row kernels are built
(``quest_select``, :mod:`speculum.cache.row_kernels`), bounds, selection and the tokens to read come from
one pass per KV head and row; the torch code below is the reference it follows.

Each query row of a step selects for itself, over the pages a one-token step at its position would
find (:mod:`speculum.kv.rows`): the committed pages, and pages its tree ancestors complete, whose
bounds it takes from the step's new keys. A token's output then does not depend on how tokens were
grouped into steps, and speculation under ``quest`` gives plain decoding's output under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import fold_queries
from ..cache.row_kernels import row_kernels_for
from .rows import RowView, read_rows
from .scoring import page_bounds
from .sparse import SparseReadPolicy, SparseState


@dataclass
class QuestState(SparseState):
    """One request's page bounds."""

    kmin: torch.Tensor  # [layers, H_kv, P, d] channel-wise minimum of each completed page's keys
    kmax: torch.Tensor  # [layers, H_kv, P, d] maximum
    pages: int = 0  # completed pages with bounds


class QuestPolicy(SparseReadPolicy):
    """Query-aware page selection from per-page key bounds."""

    name = "quest"

    def __init__(self, budget="0.25", page: int = 16, dense: int = 2):
        super().__init__(budget)
        self.page = int(page)
        self.dense_layers = int(dense)

    def new_state(self, cache, read):
        s = cache.layout
        shape = (s.layers, s.kv_heads, cache.capacity // self.page + 1, s.head_dim)
        return QuestState(read, torch.empty(shape, dtype=cache.dtype, device=cache.device),
                          torch.empty(shape, dtype=cache.dtype, device=cache.device))

    def end_prefill(self, cache, n):
        super().end_prefill(cache, n)
        self.after_commit(cache)

    def after_commit(self, cache) -> None:
        """Bounds for the pages completed since the last call (all layers at once)."""
        st, p = cache.state, self.page
        done, full = st.pages, cache.length // p
        if full <= done:
            return
        if full >= st.kmin.shape[2]:  # the cache grew past the pages allocated
            grow = lambda t: torch.cat([t, torch.empty_like(t)], dim=2)
            st.kmin, st.kmax = grow(st.kmin), grow(st.kmax)
        keys = cache.kv[:, 0, :, done * p: full * p]  # [layers, H_kv, (full-done)*p, d]
        keys = keys.reshape(keys.shape[0], keys.shape[1], full - done, p, keys.shape[-1])
        st.kmin[:, :, done:full] = keys.amin(3)
        st.kmax[:, :, done:full] = keys.amax(3)
        st.pages = full

    def bounds(self, cache, layer: int, q: torch.Tensor, rows: RowView, pages: int) -> torch.Tensor:
        """Each row's upper bound of every page's attention logit (the largest over the KV group's query
        heads): ``[H_kv, n, pages]``, the committed pages' from their stored bounds, a page that a row's
        ancestors complete from its keys in this step (the new entries are written), -inf past a
        row's completed pages."""
        st, s, p, n = cache.state, cache.layout, self.page, rows.n
        qg = fold_queries(q, s.kv_heads)  # [H_kv, g*n, d]
        done = st.pages
        out = torch.full((s.kv_heads, n, pages), float("-inf"), device=q.device)
        out[:, :, :done] = page_bounds(qg, st.kmin[layer, :, :done], st.kmax[layer, :, :done]).view(
            s.kv_heads, s.group, n, done).amax(1).float()
        if pages <= done:
            return out
        qrow = qg.view(s.kv_heads, s.group, n, -1)
        pos = torch.arange(done * p, pages * p, device=q.device)  # the pages some row's ancestors complete
        cols = rows.columns_of(pos.expand(n, -1))  # [n, (pages-done)*p], valid up to each row's own pages
        for i in range(n):
            mine = int(rows.positions[i]) // p
            if mine <= done:
                continue
            keys = cache.kv[layer, 0][:, cols[i, : (mine - done) * p]].unflatten(1, (mine - done, p))  # [H_kv, extra, p, d]
            out[:, i, done:mine] = page_bounds(qrow[:, :, i], keys.amin(2), keys.amax(2)).amax(1).float()
        return out

    def attend(self, cache, layer, sliding, q, k, v, step):
        st, p = cache.state, self.page
        if sliding or layer < self.dense_layers:
            return cache.attend_all(layer, sliding, q, k, v, step)
        rows = RowView.of(cache.length, step)
        pages = rows.positions // p  # [n] each row's completed pages
        want = ((st.read - (rows.positions - pages * p)) // p).clamp(min=1)  # pages it reads besides its last
        covered = (rows.positions <= st.read) | (want >= pages)
        if bool(covered.all()):
            return cache.attend_all(layer, sliding, q, k, v, step)
        cache.write(layer, k, v)  # the new entries at slots L .. L+n-1: every column a slot
        ops = row_kernels_for(q)
        if ops is not None:  # bounds, selection and tokens per KV head and row in one pass, read in place
            anc = rows.ancestor_columns() if int(rows.positions.max()) > rows.length else pages.new_zeros(rows.n, 0)
            visible = ops.quest_select(q.float().contiguous(), cache.kv[layer, 0], st.kmin[layer], st.kmax[layer],
                                       st.pages, rows.positions.long().contiguous(),
                                       torch.where(covered, pages, want).long().contiguous(), anc.contiguous(),
                                       rows.length, p)
            return read_rows(cache, layer, q, k, v, visible, rows, step)
        most = int(pages.max())
        bound = self.bounds(cache, layer, q, rows, most)  # [H_kv, n, most]
        # each row's ``want`` best pages (ties to the earlier page), all of them for a covered row
        order = bound.sort(dim=-1, descending=True, stable=True).indices  # [H_kv, n, most]
        ranked = torch.arange(most, device=q.device).expand_as(order) < want[None, :, None]
        chosen = torch.zeros_like(ranked).scatter_(-1, order, ranked) | covered[None, :, None]
        _, inside = rows.position_columns
        pos = torch.arange(inside.shape[1], device=q.device)
        page_of = (pos // p).clamp(max=most - 1)
        in_chosen = chosen[:, :, page_of] & (pos < pages[:, None] * p)  # [H_kv, n, P] in a chosen page
        tail = inside & (pos >= pages[:, None] * p)  # the row's unfinished page
        return read_rows(cache, layer, q, k, v, rows.to_columns((in_chosen | tail) & inside), rows, step)
