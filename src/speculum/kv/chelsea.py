"""``chelsea``: Chelsea (Hu et al., 2025, "Efficient Long-Context LLM Inference via KV Cache
Clustering", arXiv 2506.11418): keys of neighbouring tokens are much alike, so the prompt's cache
is cut into chunks and, inside each chunk, similar entries are clustered and each cluster is kept
as one merged entry (its centroid key and mean value) instead of dropping any token.

Chunked soft matching, as speculum reads the paper's description (speculum found no code of it):
the entries of a chunk are split alternately into two sets (entries 0, 2, 4, .. form ``A``; 1, 3,
5, .. form ``B``); every ``A`` entry finds its most similar ``B`` entry (cosine of keys), and the
``r`` most similar such pairs are merged, ``A`` into ``B`` (ToMe's bipartite soft matching inside a
chunk). Rounds repeat over the surviving entries, re-split alternately, until each chunk holds its
share of the budget. A merged entry is the size-weighted mean of its cluster's keys and values, at
the slot of its ``B`` representative.

What speculum adds (options, not from the paper):

- ``bias`` (on): a cluster of ``s`` tokens is read with ``log s`` added to its attention logit
  (ToMe's proportional attention, :class:`~speculum.cache.MergedKVCache`), so that it receives
  about the weight its members would have; ``chelsea:bias=0`` reads plain centroids.
- ``window`` (32, at most half the budget): the prompt's last tokens (where the question sits) and
  the few left over after the last whole chunk are kept unmerged.
- ``sinks`` (4, at most a quarter of the budget): the first tokens, which draw much of every
  query's attention (StreamingLLM's attention sinks), are kept unmerged; merged into their
  neighbours they change what every query reads.
- ``chunk`` (16; the paper's size was not found): entries per chunk; widened when the budget is so small that a chunk would get
  no entry.

Clustering happens once, at prefill (full-attention layers; sliding-window layers keep their
recent entries); generated tokens are appended unmerged, so the cache is the same whatever the
steps' grouping of tokens (step-invariant).

Example, one chunk of 8 entries ``t0 .. t7`` to be kept as 3: round 1 splits ``A = t0 t2 t4 t6``,
``B = t1 t3 t5 t7`` and merges the 4 best pairs, say ``t0->t1, t2->t3, t4->t5, t6->t7`` (4 entries
left, sizes 2); round 2 splits those 4 into ``A = {t0,t1}, {t4,t5}`` and ``B = {t2,t3}, {t6,t7}``
and merges the best pair, say ``{t4,t5}->{t6,t7}``: the chunk keeps ``{t0,t1}``, ``{t2,t3}`` (bias
``log 2``) and ``{t4..t7}`` (bias ``log 4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import MergedKVCache
from ..options import parse_flag
from .eviction import EvictionPolicy, recent
from .merging import cosine, put_back, take


@dataclass
class ChunkPlan:
    """How a prompt of ``n`` tokens is clustered to ``m`` entries per KV head."""

    start: int  # tokens before the chunks, kept whole (the attention sinks)
    chunk: int  # entries per chunk
    chunks: int  # C whole chunks over tokens start .. start + C*chunk - 1; the rest is kept whole
    targets: torch.Tensor  # [C] entries each chunk keeps (sum: m minus the tokens kept whole)


def plan(n: int, m: int, chunk: int, window: int, sinks: int, device) -> ChunkPlan | None:
    """Chunks of ``chunk`` tokens (or wider, so that each keeps at least one entry) between the first
    ``sinks`` and the last ``window`` tokens, their shares of the ``m - kept whole`` entries as even
    as can be; None when no chunk can keep an entry (the caller keeps the recent ``m``)."""
    middle = n - window - sinks
    if middle < 1 or m - window - sinks < 1:
        return None
    c = max(chunk, -(-middle // (m - window - sinks)))
    while True:
        chunks = middle // c
        share = m - (n - chunks * c)
        if chunks == 0:
            return None
        if share >= chunks:
            base, extra = divmod(share, chunks)
            targets = torch.full((chunks,), base, dtype=torch.long, device=device)
            targets[:extra] += 1
            return ChunkPlan(sinks, c, chunks, targets)
        c += 1


def cluster_chunks(keys: torch.Tensor, values: torch.Tensor, targets: torch.Tensor):
    """Chunked soft matching of ``keys, values [H, C, c, d]`` down to ``targets [C]`` entries per chunk.

    Returns ``alive [H, C, c]`` (True at each cluster's representative slot, ``targets[j]`` of them
    in chunk ``j``), the merged ``keys, values [H, C, c, d]`` float32 (meaningful where alive) and
    ``size [H, C, c]`` float32 (tokens in each cluster).
    """
    ksum, vsum = keys.float().clone(), values.float().clone()  # size-weighted sums of each cluster
    size = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    need = targets[None, :, None]
    while True:
        alive = size > 0
        excess = alive.sum(-1, keepdim=True) - need  # [H, C, 1], the same for every head
        if not bool((excess > 0).any()):
            return alive, ksum / size.clamp(min=1)[..., None], vsum / size.clamp(min=1)[..., None], size
        rank = alive.long().cumsum(-1) - 1
        a_set, b_set = alive & (rank % 2 == 0), alive & (rank % 2 == 1)
        sim = cosine(ksum, ksum)  # centroids' directions: the sums' own
        sim.masked_fill_(~(a_set[..., :, None] & b_set[..., None, :]), float("-inf"))
        best, into = sim.max(-1)  # [H, C, c]
        order = best.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1, stable=True)  # rank of each A by similarity
        merge = a_set & (order < excess)  # the best min(|A|, excess) pairs of each chunk
        w = merge.float()
        size.scatter_add_(-1, into, size * w)
        ksum.scatter_add_(-2, into[..., None].expand_as(ksum), ksum * w[..., None])
        vsum.scatter_add_(-2, into[..., None].expand_as(vsum), vsum * w[..., None])
        size.masked_fill_(merge, 0)


class ChelseaPolicy(EvictionPolicy):
    """Chunked clustering of the prompt's entries, at prefill; see the module docstring for the options."""

    name = "chelsea"
    evicts_while_decoding = False

    def __init__(self, budget="0.25", chunk: int = 16, window: int = 32, sinks: int = 4, bias=True):
        super().__init__(budget)
        self.chunk, self.window, self.sinks, self.bias = int(chunk), int(window), int(sinks), parse_flag(bias)
        if self.chunk < 2 or self.window < 0 or self.sinks < 0:
            raise ValueError("chelsea needs chunk >= 2, window >= 0 and sinks >= 0")

    def new_cache(self, layout, dtype, device, capacity):
        return MergedKVCache(layout, dtype, device, capacity)

    def store_prefill(self, cache, layer, sliding, kv, scores):
        n, m = kv.shape[2], cache.state.kept
        p = None
        if not sliding and m < n:
            p = plan(n, m, self.chunk, min(self.window, m // 2), min(self.sinks, m // 4), kv.device)
        if p is None:  # nothing to merge, a sliding-window layer, or too small a budget: the recent m
            cache.store_layer(layer, kv, None if m >= n else recent(n, m, kv.shape[1], kv.device))
            return
        idx, size = self.merge_prefill(kv, p)
        cache.store_layer(layer, kv, idx)
        if self.bias:
            cache.set_bias(layer, size.log())

    @staticmethod
    def merge_prefill(kv: torch.Tensor, p: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Cluster ``kv [2, H_kv, n, d]``'s chunks in place (merged entries written at their
        representatives' slots) -> the kept slots ``[H_kv, m]`` (increasing; the tokens before and
        after the chunks kept whole) and each one's cluster size ``[H_kv, m]``."""
        heads, n, d = kv.shape[1], kv.shape[2], kv.shape[3]
        a, b = p.start, p.start + p.chunks * p.chunk
        grid = kv[:, :, a:b].reshape(2, heads, p.chunks, p.chunk, d)
        alive, keys, values, size = cluster_chunks(grid[0], grid[1], p.targets)
        slots = alive.view(heads, b - a).nonzero()[:, 1].view(heads, -1)  # [H_kv, sum(targets)]
        merged = torch.stack([keys.view(heads, b - a, d), values.view(heads, b - a, d)])
        put_back(kv[:, :, a:b], slots, take(merged, slots))
        whole = torch.cat([torch.arange(a), torch.arange(b, n)]).to(kv.device)  # sinks, window: single tokens
        idx = torch.cat([whole[None, :a].expand(heads, a), slots + a, whole[None, a:].expand(heads, n - b)], 1)
        sizes = torch.ones(idx.shape, device=kv.device)
        sizes[:, a:a + slots.shape[1]] = size.view(heads, b - a).gather(1, slots)
        return idx, sizes
