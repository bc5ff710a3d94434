"""``shadowkv``: ShadowKV (Sun et al., 2024, "ShadowKV: KV Cache in Shadows for High-Throughput
Long-Context LLM Inference"). Pre-RoPE keys are low-rank, so the prompt's keys are stored as a
truncated SVD of their pre-RoPE form (all KV heads side by side); values stay whole. The prompt is
cut into chunks of 8 tokens, each summarised by a landmark (its mean post-RoPE key); the chunks
whose keys stray most from their landmark (lowest cosine similarity) are outliers and kept whole,
with the prompt's last tokens. At every step each full-attention layer scores the landmarks with
the query, takes the best chunks within the budget, rebuilds only their keys (low-rank product,
then RoPE at their positions) and attends over them, the outliers and the recent tokens
(:class:`~speculum.cache.shadow.ShadowKVCache`).

Each row of a tree step selects for itself from the same landmarks, so verification reads what a
one-token step at the row's position reads. The paper offloads the values to CPU memory; on a CPU
there is no other memory, so they are kept and counted.

Example, a 1000-token prompt, budget 64: 121 chunks of 8 (the last 32 tokens whole), the 48 with the
lowest landmark similarity whole too; each step reads 8 of the other 73 chunks per KV head,
rebuilding 64 keys from ``u [968, r] @ sv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.shadow import ShadowKVCache
from .base import KVPolicy
from .eviction import recent


@dataclass
class ShadowState:
    """One request's prompt split."""

    chunks: int  # prompt chunks in the shadow (positions 0 .. chunks*chunk-1); 0: nothing compressed
    outliers: int  # of them kept whole, per KV head
    whole: int  # prompt entries kept whole per layer and head (outliers + the last tokens)
    select: int  # chunks a step reads per KV head


def outlier_chunks(keys: torch.Tensor, chunk: int,
                   outliers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ShadowKV's outliers among the chunks of ``keys [H_kv, T, d]`` (post-RoPE, ``T`` whole chunks): the
    ``outliers`` chunks whose least similar key has the lowest cosine similarity with the chunk's
    mean. Returns the outlier chunks ``[H_kv, o]`` and the others ``[H_kv, c]``, each increasing, and
    the landmarks ``[H_kv, c, d]`` of the others."""
    t, d = keys.shape[1:]
    split = keys.float().unflatten(1, (t // chunk, chunk))  # [H, C, chunk, d]
    means = split.mean(2)  # [H, C, d]
    worst = F.cosine_similarity(means[:, :, None], split, dim=-1).amin(-1)  # [H, C]
    order = worst.argsort(dim=-1, stable=True)
    out, rest = order[:, :outliers].sort(-1).values, order[:, outliers:].sort(-1).values
    return out, rest, means.gather(1, rest[..., None].expand(-1, -1, d))


class ShadowKVPolicy(KVPolicy):
    """Low-rank pre-RoPE keys with landmark-selected sparse reads; the budget is the sparse read
    (tokens of selected chunks per KV head and step).

    Options: ``rank`` 64, ``chunk`` 8, ``outliers`` 48 chunks and ``local`` 32 tokens kept whole
    (the paper's 160, 8, 48 and 4 chunks). The paper's rank 160 is 16% of Llama-3-8B's 1024
    key channels per layer (8 KV heads of 128); SmolLM2's are 192 (3 KV heads of 64), where 160 would
    keep 83% of the width and save nothing, so the default is a third of it. On a model with
    sliding-window layers (Gemma-3), every layer keeps the same number of whole entries, at
    least the window: sliding layers keep their window, full layers a wider local window.
    """

    name = "shadowkv"

    def __init__(self, budget="0.25", rank: int = 64, chunk: int = 8, outliers: int = 48, local: int = 32):
        super().__init__(budget)
        self.rank, self.chunk, self.outliers, self.local = int(rank), int(chunk), int(outliers), int(local)
        if min(self.rank, self.chunk) < 1 or min(self.outliers, self.local) < 0:
            raise ValueError(f"shadowkv takes rank, chunk >= 1 and outliers, local >= 0, got {rank}, {chunk}, "
                             f"{outliers}, {local}")

    def __repr__(self) -> str:
        return f"shadowkv(budget={self.budget}, rank={self.rank})"

    def new_cache(self, layout, dtype, device, capacity: int) -> ShadowKVCache:
        return ShadowKVCache(layout, dtype, device, capacity, self.chunk)

    def begin_prefill(self, cache: ShadowKVCache, n: int) -> None:
        s, c = cache.layout, self.chunk
        window = s.window if any(s.sliding) else 0
        local = max(self.local, min(n, window) - self.outliers * c)
        chunks = max(0, (n - local) // c)
        outliers = min(self.outliers, chunks)
        if chunks == outliers:  # nothing left to select from: everything whole
            chunks = outliers = 0
        whole = n - (chunks - outliers) * c
        select = max(1, self.budget.for_length(n) // c)
        cache.state = ShadowState(chunks, outliers, whole, select)
        cache.reserve(whole + max(cache.capacity_hint - n, 1))

    def store_prefill(self, cache: ShadowKVCache, layer: int, sliding: bool, kv: torch.Tensor, scores) -> None:
        st, c = cache.state, self.chunk
        heads, n = kv.shape[1], kv.shape[2]
        if st.chunks == 0:
            cache.store_layer(layer, kv, None)
            return
        if sliding:
            cache.store_layer(layer, kv, recent(n, st.whole, heads, kv.device))
            return
        t = st.chunks * c
        out, rest, landmarks = outlier_chunks(kv[0, :, :t], c, st.outliers)
        span = torch.arange(c, device=kv.device)
        kept = torch.cat([(out[..., None] * c + span).flatten(1), torch.arange(t, n, device=kv.device).expand(heads, -1)], 1)
        cache.store_layer(layer, kv, kept)
        cache.store_shadow(layer, kv[:, :, :t], rest, landmarks, self.rank)

    def end_prefill(self, cache: ShadowKVCache, n: int) -> None:
        cache.length, cache.evicted = cache.state.whole, n - cache.state.whole
        cache.peak_bytes = cache.nbytes()

    def attend(self, cache, layer, sliding, q, k, v, step):
        if cache.shadow[layer] is None:
            return cache.attend_all(layer, sliding, q, k, v, step)
        return cache.attend_shadow(layer, q, k, v, step, cache.state.select)
