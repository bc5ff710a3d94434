"""Attention probabilities for the policies that score cached tokens (H2O, SnapKV, TidalDecode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import attention_probs as folded_probs


def attention_probs(decoder, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention weights ``[H_kv, g*n, L]`` (float32) of ``q [n, H, d]`` over ``k [H_kv, L, d]``
    with ``decoder``'s scale and soft-capping. ``mask``: additive, ``[g*n, L]`` or ``[H_kv, g*n, L]``, or None."""
    return folded_probs(q, k, mask, decoder.shape.attn_scale, decoder.shape.attn_softcap)


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``scores [H_kv, n]`` along tokens (odd ``kernel``, same length): a token scores as
    its best neighbour, so selection keeps runs of neighbours (whole numbers, whole words)."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0, : scores.shape[1]]


def top_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best slots per row of ``scores [H, n]``, as increasing indices ``[H, k]``."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values
