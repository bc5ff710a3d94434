"""``double_sparsity``: Double Sparsity (Yang et al., 2024, "Post-Training Sparse Attention with
Double Sparsity"). Token sparsity (read only the top-k tokens) found through channel sparsity: a
few *label* channels per head carry most of the query-key product, so the keys' label channels,
stored contiguously in a small *label cache*, give approximate attention scores cheaply; the
``k`` tokens with the best approximate scores are then read in full.

The paper picks each head's label channels offline, on calibration text, as the channels with
the largest mean ``|q_c k_c|`` (a token's query times its own key, after rotary embedding). Here
they are picked at prefill from the prompt itself: the last ``observation_window`` prompt queries
and their own keys, per KV head (its query heads' statistics summed). The label cache is filled
at prefill and kept up to date at every commit; a step's new entries give their labels directly.

Per KV head, the approximate probabilities (a softmax of the label scores over the row's
candidates, per query head) are summed over the group's query heads, and each query row takes its
own top-k over its context (:mod:`speculum.kv.rows`), so tree verification reads what one-token
steps read.

Example (one head, ``d = 4``, ``channels = 1``): queries and keys put their weight on channel 2,
so the label is ``[2]`` and the label cache holds ``K[:, 2]``; a query ``q`` scores token ``t`` as
``q_2 K[t, 2]`` and reads the top-k of those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import fold_queries
from .rows import RowSparsePolicy, RowView, masked_softmax, top_visible
from .sparse import SparseState


@dataclass
class DoubleSparsityState(SparseState):
    """One request's label channels and label cache (sparse layers only)."""

    labels: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, r] channel indices
    label_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, C, r] keys' labels
    filled: int = 0  # committed slots whose labels are in the label cache

    def side_bytes(self) -> int:
        """The label cache's committed part."""
        return sum(t.shape[0] * self.filled * t.shape[2] * t.element_size() for t in self.label_keys.values())


def label_channels(queries: torch.Tensor, keys: torch.Tensor, r: int) -> torch.Tensor:
    """The ``r`` channels with the largest mean ``|q_c k_c|``: ``queries [w, H, d]`` and their own
    ``keys [H_kv, w, d]`` -> ``[H_kv, r]`` channel indices (increasing)."""
    qg = fold_queries(queries, keys.shape[0])  # [H_kv, g*w, d], row j*w + t: head j of the group, token t
    g = qg.shape[1] // keys.shape[1]
    product = qg.float().view(keys.shape[0], g, keys.shape[1], -1).abs() * keys.float().abs()[:, None]
    return product.mean((1, 2)).topk(r, dim=-1).indices.sort(dim=-1).values


class DoubleSparsityPolicy(RowSparsePolicy):
    """Label-channel scores, top-k tokens read in full.

    Options: ``channels``: label channels per head (default ``head_dim // 8``, the paper's 16 of
    128); ``sinks``, ``window``: the first and the most recent tokens, always read (default 0: the
    paper reads the top-k only); ``dense``: leading layers that attend densely (2, as the other
    sparse-read policies: speculum's convention, not the paper's).
    """

    name = "double_sparsity"
    prefill_scores = "queries"

    def __init__(self, budget="0.25", channels: int | None = None, sinks: int = 0, window: int = 0, dense: int = 2):
        super().__init__(budget)
        self.channels = None if channels is None else int(channels)
        self.sinks, self.window, self.dense_layers = int(sinks), int(window), int(dense)
        if self.channels is not None and self.channels < 1:
            raise ValueError(f"channels must be at least 1, got {self.channels}")
        if min(self.sinks, self.window, self.dense_layers) < 0:
            raise ValueError("sinks, window and dense must be non-negative")

    def new_state(self, cache, read):
        return DoubleSparsityState(read)

    def label_count(self, head_dim: int) -> int:
        return min(head_dim, self.channels if self.channels is not None else max(1, head_dim // 8))

    def store_prefill(self, cache, layer, sliding, kv, scores):
        cache.store_layer(layer, kv, None)
        if sliding or layer < self.dense_layers or scores is None:
            return
        st, n = cache.state, kv.shape[2]
        labels = label_channels(scores, kv[0, :, n - scores.shape[0]:], self.label_count(kv.shape[-1]))
        st.labels[layer] = labels
        st.label_keys[layer] = self.gather_labels(kv[0], labels, cache.capacity)

    @staticmethod
    def gather_labels(keys: torch.Tensor, labels: torch.Tensor, capacity: int) -> torch.Tensor:
        """``keys [H_kv, n, d]`` -> a label cache ``[H_kv, capacity, r]`` holding their label channels first."""
        out = torch.zeros((keys.shape[0], capacity, labels.shape[1]), dtype=keys.dtype, device=keys.device)
        out[:, : keys.shape[1]] = keys.gather(2, labels[:, None, :].expand(-1, keys.shape[1], -1))
        return out

    def end_prefill(self, cache, n):
        super().end_prefill(cache, n)
        cache.state.filled = n

    def after_commit(self, cache) -> None:
        """The committed entries' label channels into the label cache (grown with the cache)."""
        st = cache.state
        a, b = st.filled, cache.length
        if b <= a:
            return
        for layer, labels in st.label_keys.items():
            if labels.shape[1] < b:
                grown = torch.zeros((labels.shape[0], cache.capacity, labels.shape[2]), dtype=labels.dtype,
                                    device=labels.device)
                grown[:, :a] = labels[:, :a]
                st.label_keys[layer] = labels = grown
            keys = cache.kv[layer, 0, :, a:b]  # [H_kv, b-a, d]
            labels[:, a:b] = keys.gather(2, st.labels[layer][:, None, :].expand(-1, b - a, -1))
        st.filled = b

    def covers(self, st, rows):
        return int(rows.positions.max()) <= st.read + self.sinks + self.window

    def select(self, cache, layer, q, k, rows: RowView):
        st, s = cache.state, cache.layout
        labels = st.labels[layer]  # [H_kv, r]
        qg = fold_queries(q, s.kv_heads)  # [H_kv, g*n, d]
        q_label = qg.gather(2, labels[:, None, :].expand(-1, qg.shape[1], -1))  # [H_kv, g*n, r]
        new_label = k.transpose(0, 1).gather(2, labels[:, None, :].expand(-1, rows.n, -1))  # [H_kv, n, r]
        cached = st.label_keys[layer][:, : rows.length]  # [H_kv, L, r]
        approx = torch.cat([torch.matmul(q_label, cached.transpose(1, 2)), torch.matmul(q_label, new_label.transpose(1, 2))],
                           dim=2).float().mul_(s.scale)  # [H_kv, g*n, L+n]
        always = rows.always(self.sinks, self.window)
        candidates = rows.context & ~always  # [n, L+n]
        probs = masked_softmax(approx.view(s.kv_heads, s.group, rows.n, -1), candidates).sum(1)  # [H_kv, n, L+n]
        return top_visible(probs, candidates, st.read) | always
