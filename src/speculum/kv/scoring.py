"""Attention probabilities for the policies that score cached tokens (H2O, SnapKV, TidalDecode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fold_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``q [n, H, d]`` -> ``[H_kv, g*n, d]``: row ``j*n + i`` is query ``i`` of head ``j`` of a KV group."""
    n, heads, d = q.shape
    g = heads // kv_heads
    return q.view(n, kv_heads, g, d).permute(1, 2, 0, 3).reshape(kv_heads, g * n, d)


def attention_probs(decoder, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention weights ``[H_kv, g*n, L]`` (float32) of ``q [n, H, d]`` over ``k [H_kv, L, d]``.

    ``mask``: additive, ``[g*n, L]`` or ``[H_kv, g*n, L]``, or None. Same scale and soft-capping as
    the decoder's attention.
    """
    s = decoder.shape
    scores = torch.matmul(fold_queries(q, s.kv_heads), k.transpose(-1, -2)).float() * s.attn_scale
    if s.attn_softcap is not None:
        scores = torch.tanh(scores / s.attn_softcap) * s.attn_softcap
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``scores [H_kv, n]`` along tokens (odd ``kernel``, same length): a token scores as
    its best neighbour, so selection keeps runs of neighbours (whole numbers, whole words)."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0, : scores.shape[1]]


def top_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best slots per row of ``scores [H, n]``, as increasing indices ``[H, k]``."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values
