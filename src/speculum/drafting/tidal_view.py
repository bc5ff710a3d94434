"""TidalDecode's view of the cache for a draft (``kv_draft`` ``tidal``; Yang et al., 2024).

Full-attention layers up to the first selection layer, and the selection layers, read every
committed entry; a selection layer also picks, per KV head, the ``tokens`` committed entries between
the sinks and the recent window that the draft's rows attend to most (summed over the rows and the
KV head's query heads, max-pooled over ``kernel`` neighbours: the scoring of
:class:`~speculum.kv.tidal.TidalPolicy`), and the full-attention layers after it, up to the next
selection layer, read only the sinks, those entries and the window. The selection layers are the
policy's (:func:`~speculum.kv.tidal.default_selection_layers` unless given). The draft picks once per forward for
all its rows, where the policy picks per row: a draft's choice needs no exactness.

Shapes: ``n`` rows, ``H`` query heads, ``H_kv`` KV heads, ``g = H / H_kv``, ``d`` the head size,
``L`` keys read.
"""

from __future__ import annotations

import torch

from ..attention import attention_probs, unfold_rows
from ..kv.scoring import pool_scores, top_slots


def select_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                      softcap: float | None, lo: int, hi: int, tokens: int,
                      kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [n, H, d]`` over every entry ``k, v [H_kv, L, d]`` (additive ``mask [g*n, L]``)
    -> ``[n, H*d]``, and the ``tokens`` slots in ``lo .. hi`` per KV head that receive the most
    attention, as increasing slots ``[H_kv, tokens]``."""
    probs = attention_probs(q, k, mask, scale, softcap)  # [H_kv, g*n, L] float32
    out = unfold_rows(torch.matmul(probs.to(v.dtype), v), q.shape[0])
    scores = pool_scores(probs.sum(1)[:, lo:hi], kernel)  # [H_kv, hi - lo]
    return out, top_slots(scores, min(tokens, hi - lo)) + lo


def sparse_keys(t: torch.Tensor, sink: int, chosen: torch.Tensor, recent: int, end: int) -> torch.Tensor:
    """``t [H_kv, C, d]`` (keys or values) -> ``[H_kv, sink + B + end - recent, d]``: the sinks, the
    chosen slots ``chosen [H_kv, B]``, then slots ``recent .. end`` (the window and the pending entries)."""
    picked = t.gather(1, chosen[..., None].expand(-1, -1, t.shape[-1]))
    return torch.cat([t[:, :sink], picked, t[:, recent:end]], dim=1)
