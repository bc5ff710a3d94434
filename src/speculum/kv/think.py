"""``think``: ThinK (Xu et al., 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning"). Key
channels matter unequally to attention: per KV head, channel ``c`` scores
``||Q_w[:, c]|| * ||K[:, c]||`` (the Frobenius norm of its rank-one share ``Q_w[:, c] K[:, c]^T`` of the
observation window's attention logits ``Q_w K^T``), and only the best ``1 - prune`` of the channels
are kept for the prompt's keys; queries are cut to the same channels when they read them
(:class:`~speculum.cache.pruned.ChannelPrunedKVCache`). The most recent prompt keys and every
generated key stay whole, as in the paper. Values are untouched. Decisions are taken at prefill
only, so tree speculation reads what one-token steps read.

``snapkv=1`` composes ThinK with SnapKV's token selection (the paper's main setting): the budget
first keeps SnapKV's tokens, then ThinK prunes their keys' channels.

Example: head dim 64, ``prune=0.4``: each KV head keeps the 38 channels with the largest
``||Q_w[:, c]|| * ||K[:, c]||``; a prompt of 1000 tokens keeps 968 keys of 38 channels and the last 32
whole, for 1000 whole values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.pruned import ChannelPrunedKVCache
from .eviction import EvictionState, recent
from .scoring import observation_weights
from .snapkv import SnapKVPolicy


@dataclass
class ThinKState(EvictionState):
    """One request's split of the kept prompt entries."""

    whole: int  # the last kept prompt entries, stored with every key channel


def channel_scores(qw: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """ThinK's query-driven channel importance ``||Q_w[:, c]||^2 ||K[:, c]||^2`` per KV head (the square of
    the paper's score, same order): window queries ``qw [w, H, d]`` (their rows, the query heads of
    each KV group stacked), ``keys [H_kv, m, d]`` -> ``[H_kv, d]`` float32."""
    kv_heads, d = keys.shape[0], keys.shape[-1]
    qn = qw.float().pow(2).sum(0).view(kv_heads, -1, d).sum(1)  # [H_kv, d]
    return qn * keys.float().pow(2).sum(1)


class ThinKPolicy(SnapKVPolicy):
    """Query-driven key-channel pruning: ``prune`` 0.4 (the fraction of channels dropped; the paper
    reports 0.4 and 0.5), ``window`` 32 observation queries, ``recent`` 32 prompt keys kept whole (the
    reference code's defaults); ``snapkv`` 0 (1: SnapKV's token selection by the budget first,
    ``kernel`` its pooling). Sliding-window layers (Gemma-3) keep their keys whole."""

    name = "think"
    prefill_scores = "queries"

    def __init__(self, budget="0.25", prune: float = 0.4, window: int = 32, recent: int = 32, snapkv=0,
                 kernel: int = 15):
        super().__init__(budget, window, kernel)
        self.prune, self.recent = float(prune), int(recent)
        self.select = self.uses_budget = str(snapkv).lower() not in ("0", "false", "no")
        if not 0 <= self.prune < 1 or self.recent < 0:
            raise ValueError(f"think takes prune in [0, 1) and recent >= 0, got {prune}, {recent}")

    def __repr__(self) -> str:
        return f"think(prune={self.prune:g}" + (f", snapkv, budget={self.budget})" if self.select else ")")

    def new_cache(self, layout, dtype, device, capacity: int) -> ChannelPrunedKVCache:
        return ChannelPrunedKVCache(layout, dtype, device, capacity)

    def begin_prefill(self, cache: ChannelPrunedKVCache, n: int) -> None:
        kept = min(self.budget.for_length(n), n) if self.select else n
        whole = min(self.recent, kept)
        cache.state = ThinKState(budget=kept, kept=kept, whole=whole)
        cache.reserve(whole + max(cache.capacity_hint - n, 1))  # the whole entries only

    def store_prefill(self, cache: ChannelPrunedKVCache, layer: int, sliding: bool, kv: torch.Tensor,
                      queries: torch.Tensor) -> None:
        st, (_, heads, n, d) = cache.state, kv.shape
        positions = torch.arange(n, device=kv.device).expand(heads, n)
        if st.kept < n:
            if sliding:
                positions = recent(n, st.kept, heads, kv.device)
            else:
                s = cache.layout
                rows = self.query_rows(n).to(kv.device)
                votes = observation_weights(queries, rows, kv[0], s.scale, s.softcap).sum(1)
                positions = self.select_prefill(kv, votes, st.kept)
            kv = torch.stack([torch.stack([x[h].index_select(0, positions[h]) for h in range(heads)]) for x in kv])
        chan, keep = None, d - round(self.prune * d)
        if not sliding and keep < d and n > st.whole:
            chan = channel_scores(queries, kv[0]).topk(keep, dim=-1).indices.sort(dim=-1).values
        cache.store_split(layer, kv, positions, st.whole, chan)

    def end_prefill(self, cache: ChannelPrunedKVCache, n: int) -> None:
        st = cache.state
        cache.length, cache.evicted, cache.prefix = st.whole, n - st.kept, st.kept - st.whole
        cache.peak_bytes = cache.nbytes()

    def attend(self, cache, layer, sliding, q, k, v, step):
        return cache.attend_pruned(layer, sliding, q, k, v, step)
