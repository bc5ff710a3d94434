"""``squeezed``: Squeezed Attention (Hooper et al., 2024, "Squeezed Attention: Accelerating Long
Context Length LLM Inference"). The keys of the fixed context (here: the prompt as prefilled) are
clustered offline by k-means, per head, each cluster represented by its centroid. At decode time a
query compares with the centroids: cluster ``j`` of ``N_j`` keys gets the estimated attention of
one of its keys, ``S_j = exp(q.C_j) / sum_l N_l exp(q.C_l)``, and only the keys of the clusters
that matter are read; everything after the fixed context (a question appended, generated tokens)
is always read. The paper keeps the clusters with ``S_j`` above a threshold calibrated offline
for a target sparsity; speculum's default takes the best clusters until the budget's token count
is reached (``threshold=`` gives the paper's rule). ``levels=2`` is the hierarchical version:
coarse centroids (clustering the fine ones) are compared first, and only the fine clusters under
the best coarse ones compete.

Clustering happens at prefill (``iters`` Lloyd iterations from evenly spaced keys, per KV head of
each sparse layer). The choice depends on the row's query alone, so tree verification reads what
one-token steps read (:mod:`speculum.kv.rows`). Per KV head, ``S_j`` is averaged over the head's
query rows.

Example: 12 fixed keys in 3 clusters of 4 (centroids ``C_0, C_1, C_2``), budget 4: a query with
``q.C_1`` far above the others estimates ``S_1`` near 1/4 and the others near 0, and reads the 4
keys of cluster 1 plus every token after the fixed context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..attention import fold_queries
from .rows import RowSparsePolicy, RowView
from .sparse import SparseState


@dataclass
class Clusters:
    """One layer's clustering of the fixed context's keys."""

    centroids: torch.Tensor  # [H_kv, K, d]
    sizes: torch.Tensor  # [H_kv, K] float32 keys per cluster
    assign: torch.Tensor  # [H_kv, A] long: each fixed-context key's cluster
    coarse: torch.Tensor | None = None  # [H_kv, K1, d] centroids of the centroids (levels=2)
    coarse_sizes: torch.Tensor | None = None  # [H_kv, K1] keys under each
    parent: torch.Tensor | None = None  # [H_kv, K] each fine cluster's coarse cluster


@dataclass
class SqueezedState(SparseState):
    """One request's clusters (sparse layers only)."""

    fixed: int = 0  # A: tokens of the fixed context
    clusters: dict[int, Clusters] = field(default_factory=dict)

    def side_bytes(self) -> int:
        """Centroids, cluster sizes and each fixed-context key's cluster."""
        return sum(t.numel() * t.element_size() for c in self.clusters.values()
                   for t in (c.centroids, c.sizes, c.assign, c.coarse, c.coarse_sizes, c.parent) if t is not None)


def kmeans(x: torch.Tensor, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per batch entry of ``x [B, N, d]`` (float32), seeded by farthest points
    (deterministic) -> ``centroids [B, k, d]``, ``assign [B, N]``. Empty clusters keep their centroid."""
    B, d = x.shape[0], x.shape[2]
    c = farthest_points(x, k)
    for _ in range(max(1, iters)):
        assign = nearest(x, c)
        sums = torch.zeros_like(c).scatter_add_(1, assign[..., None].expand(-1, -1, d), x)
        counts = torch.zeros((B, k), device=x.device).scatter_add_(1, assign, torch.ones_like(assign, dtype=x.dtype))
        c = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], c)
    return c, nearest(x, c)


def farthest_points(x: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` seeds per batch entry of ``x [B, N, d]``: the first point, then each time the point
    farthest from the seeds so far -> ``[B, k, d]``."""
    B, d = x.shape[0], x.shape[2]
    rows = torch.arange(B, device=x.device)
    seeds = torch.zeros((B, k), dtype=torch.long, device=x.device)
    dist = ((x - x[:, :1]) ** 2).sum(-1)  # [B, N] to the nearest seed
    for i in range(1, k):
        seeds[:, i] = dist.argmax(1)
        dist = torch.minimum(dist, ((x - x[rows, seeds[:, i]][:, None]) ** 2).sum(-1))
    return x.gather(1, seeds[..., None].expand(-1, -1, d)).clone()


def nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The nearest centroid (L2) of each point: ``x [B, N, d]``, ``c [B, k, d]`` -> ``[B, N]``."""
    return ((c * c).sum(-1)[:, None, :] - 2 * torch.matmul(x, c.transpose(1, 2))).argmin(-1)


class SqueezedPolicy(RowSparsePolicy):
    """Centroid lookup over the fixed context's clustered keys.

    Options: ``ratio`` (0.05): centroids per fixed-context token (the paper sizes the number of
    clusters as a fraction of the context); ``iters`` (10): k-means iterations; ``threshold``:
    the paper's rule, keep clusters whose estimated per-key attention exceeds it (default: none,
    fill the budget instead, since the paper's threshold is calibrated offline per model);
    ``levels`` (1 or 2): hierarchical lookup; ``coarse`` (4): fine clusters per coarse one;
    ``widen`` (2): the coarse level keeps this many times the budget; ``dense``: leading layers
    that attend densely (2, as the other sparse-read policies: speculum's convention).
    """

    name = "squeezed"

    def __init__(self, budget="0.25", ratio: float = 0.05, iters: int = 10, threshold: float | None = None,
                 levels: int = 1, coarse: int = 4, widen: float = 2.0, dense: int = 2):
        super().__init__(budget)
        self.ratio, self.iters = float(ratio), int(iters)
        self.threshold = None if threshold is None else float(threshold)
        self.levels, self.coarse, self.widen, self.dense_layers = int(levels), int(coarse), float(widen), int(dense)
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must lie in (0, 1], got {self.ratio}")
        if self.levels not in (1, 2):
            raise ValueError(f"levels must be 1 or 2, got {self.levels}")
        if self.coarse < 1 or self.widen < 1 or self.dense_layers < 0:
            raise ValueError("coarse and widen must be at least 1, dense non-negative")

    def new_state(self, cache, read):
        return SqueezedState(read)

    def store_prefill(self, cache, layer, sliding, kv, scores):
        cache.store_layer(layer, kv, None)
        if sliding or layer < self.dense_layers:
            return
        keys = kv[0].float()  # [H_kv, A, d]
        k = max(1, min(keys.shape[1], math.ceil(self.ratio * keys.shape[1])))
        centroids, assign = kmeans(keys, k, self.iters)
        sizes = torch.zeros(centroids.shape[:2], device=keys.device).scatter_add_(1, assign, torch.ones_like(assign, dtype=torch.float32))
        clusters = Clusters(centroids.to(kv.dtype), sizes, assign)
        if self.levels == 2:
            k1 = max(1, math.ceil(k / self.coarse))
            coarse, parent = kmeans(centroids, k1, self.iters)
            clusters.coarse, clusters.parent = coarse.to(kv.dtype), parent
            clusters.coarse_sizes = torch.zeros((keys.shape[0], k1), device=keys.device).scatter_add_(1, parent, sizes)
        cache.state.clusters[layer] = clusters

    def end_prefill(self, cache, n):
        super().end_prefill(cache, n)
        cache.state.fixed = n

    def covers(self, st, rows):
        return self.threshold is None and st.fixed <= st.read

    def estimate(self, qg: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, scale: float,
                 n: int) -> torch.Tensor:
        """``S_j`` per KV head and row: ``qg [H_kv, g*n, d]`` folded queries -> ``[H_kv, n, K]`` (mean over
        the head's query rows)."""
        logits = torch.matmul(qg, centroids.transpose(1, 2)).float().mul_(scale)  # [H_kv, g*n, K]
        share = (logits + sizes.clamp(min=1e-9).log()[:, None, :]).softmax(-1) / sizes.clamp(min=1)[:, None, :]
        return share.view(qg.shape[0], -1, n, share.shape[-1]).mean(1)

    def keep(self, est: torch.Tensor, sizes: torch.Tensor, tokens: float) -> torch.Tensor:
        """Clusters kept: ``est [H_kv, n, K]`` -> bool, by threshold or best first up to ``tokens`` keys."""
        if self.threshold is not None:
            return est > self.threshold
        order = est.argsort(dim=-1, descending=True, stable=True)
        total = sizes[:, None, :].expand_as(est).gather(-1, order).cumsum(-1)
        first = torch.zeros_like(total, dtype=torch.bool)
        first[..., 0] = True
        return torch.zeros_like(first).scatter_(-1, order, (total <= tokens) | first)

    def select(self, cache, layer, q, k, rows: RowView):
        st, s = cache.state, cache.layout
        cl = st.clusters[layer]
        qg = fold_queries(q, s.kv_heads)
        est = self.estimate(qg, cl.centroids, cl.sizes, s.scale, rows.n)  # [H_kv, n, K]
        if cl.coarse is not None:
            top = self.keep(self.estimate(qg, cl.coarse, cl.coarse_sizes, s.scale, rows.n), cl.coarse_sizes,
                            self.widen * st.read)  # [H_kv, n, K1]
            under = top.gather(-1, cl.parent[:, None, :].expand(-1, rows.n, -1))  # [H_kv, n, K]
            est = est.masked_fill(~under, -1.0)
            kept = self.keep(est, cl.sizes, st.read) & under
        else:
            kept = self.keep(est, cl.sizes, st.read)
        A = st.fixed
        visible = torch.zeros((s.kv_heads, rows.n, rows.columns), dtype=torch.bool, device=q.device)
        visible[:, :, :A] = kept.gather(-1, cl.assign[:, None, :].expand(-1, rows.n, -1))
        return visible | rows.between(A, rows.positions)
