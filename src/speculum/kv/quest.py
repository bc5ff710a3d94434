"""``quest``: Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context
LLM Inference"). The cache is cut into pages of ``page`` tokens, each summarised by the
channel-wise minimum and maximum of its keys; at each step and layer, every page gets an upper
bound of its attention score, ``sum_c max(q_c min_c, q_c max_c)``, and only the best pages (up
to the budget) are read, plus the last, unfinished page. Unlike TidalDecode every sparse layer
selects for itself, from the bounds, without reading the keys. The chosen pages are read in place
(:meth:`~speculum.cache.PositionedKVCache.attend_slots`), not copied."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import fold_queries
from .scoring import page_bounds, page_slots, top_slots
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

    def attend(self, cache, layer, sliding, q, k, v, step):
        st, p = cache.state, self.page
        pages = st.pages
        tail = cache.length - pages * p
        want = max(1, (st.read - tail) // p)
        if self.dense(cache, layer, sliding) or want >= pages:
            return cache.attend_all(layer, sliding, q, k, v, step)
        s = cache.layout
        bound = page_bounds(fold_queries(q, s.kv_heads), st.kmin[layer, :, :pages], st.kmax[layer, :, :pages]).amax(1)
        chosen = top_slots(bound.float(), want)  # [H_kv, want] page numbers
        slots = page_slots(chosen, p, pages * p, cache.length)  # with the unfinished page; read in place
        return cache.attend_slots(layer, q, k, v, slots, step)
