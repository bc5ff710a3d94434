"""Selection helpers for the policies that score cached tokens (H2O, SnapKV, TidalDecode, Quest) and
the draft views that select as they do (:mod:`speculum.drafting.self_forward`);
attention probabilities themselves come from :func:`speculum.attention.attention_probs`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import attention_probs, grouped


def pool_scores(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``scores [H_kv, n]`` along tokens (odd ``kernel``, same length): a token scores as
    its best neighbour, so selection keeps runs of neighbours (whole numbers, whole words)."""
    if kernel <= 1:
        return scores
    return F.max_pool1d(scores[:, None], kernel, stride=1, padding=kernel // 2)[:, 0, : scores.shape[1]]


def top_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best slots per row of ``scores [H, n]``, as increasing indices ``[H, k]``."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def page_bounds(qg: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of each page's attention logit, ``sum_c max(q_c min_c, q_c max_c)``, as two
    products (``q_c >= 0`` takes the maximum, ``q_c < 0`` the minimum): ``qg [H_kv, R, d]`` folded
    query rows, ``kmin``, ``kmax [H_kv, P, d]`` each page's channel-wise key minimum and maximum ->
    ``[H_kv, R, P]``."""
    return torch.matmul(qg.clamp(min=0), kmax.transpose(-1, -2)) + torch.matmul(qg.clamp(max=0), kmin.transpose(-1, -2))



def observation_weights(qw: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, scale: float,
                        softcap: float | None = None) -> torch.Tensor:
    """SnapKV's observation window: the attention weights ``[H_kv, g*w, n]`` (float32, folded rows) that
    the queries ``qw [w, H, d]`` of prompt rows ``rows [w]`` pay the prompt's ``keys [H_kv, n, d]``
    (slot ``c`` at position ``c``), causally. Summed over the rows, SnapKV's votes."""
    vis = torch.arange(keys.shape[1], device=keys.device)[None, :] <= rows[:, None]  # [w, n]
    group = qw.shape[1] // keys.shape[0]
    return attention_probs(qw, keys, grouped(vis, group, torch.float32), scale, softcap)


def page_slots(pages: torch.Tensor, page: int, tail: int, end: int) -> torch.Tensor:
    """Slot indices of the chosen pages ``pages [H, w]`` (increasing page numbers) of ``page`` slots
    each, then the slots ``tail .. end-1`` (an unfinished last page) -> ``[H, w * page + end - tail]``,
    increasing: what :meth:`~speculum.cache.PositionedKVCache.attend_slots` reads in place."""
    within = torch.arange(page, device=pages.device)
    slots = (pages[..., None] * page + within).flatten(-2)
    rest = torch.arange(tail, end, device=pages.device).expand(pages.shape[0], -1)
    return torch.cat([slots, rest], dim=-1)
