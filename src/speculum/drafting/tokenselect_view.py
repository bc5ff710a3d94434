"""TokenSelect's view of the cache for a draft (``kv_draft`` ``tokenselect``; Wu et al., 2024).

On full-attention layers from ``dense`` on, a draft forward reads the sinks, the recent window and
``tokens`` committed entries from between them, the same for every head of the layer: those with
the most *head soft votes* (each query head's softmax of its raw ``q.k`` over the candidates,
summed over the heads and the forward's rows; :class:`~speculum.kv.tokenselect.TokenSelectPolicy`'s
rule, which picks per row). The *Selection Cache* skips the vote: while a forward's query (the
rows' mean, all heads flattened) has cosine similarity at least ``threshold`` with the query that
last voted on the layer, the layer reads that vote's entries again (an
:class:`~speculum.kv.tokenselect.Anchor`, kept for the request). Layers before ``dense`` read
everything.

Shapes: ``n`` rows, ``H`` query heads, ``H_kv`` KV heads, ``d`` the head size, ``C`` candidates.
"""

from __future__ import annotations

import torch

from ..attention import attention_scores, fold_queries
from ..kv.rows import masked_softmax
from ..kv.scoring import top_slots
from ..kv.tokenselect import Anchor


def vote(q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, tokens: int) -> torch.Tensor:
    """Head soft voting of rows ``q [n, H, d]`` over the slots ``lo .. hi`` of ``keys [H_kv, L, d]``
    -> the ``tokens`` slots with the most votes, increasing, ``[tokens]``."""
    dots = attention_scores(fold_queries(q, keys.shape[0]), keys[:, lo:hi], None, 1.0)  # [H_kv, g*n, C] raw q.k
    everyone = torch.ones(hi - lo, dtype=torch.bool, device=q.device)
    votes = masked_softmax(dots, everyone).sum((0, 1))  # [C]
    return top_slots(votes[None], min(tokens, hi - lo))[0] + lo


class SelectionCache:
    """One request's last vote per layer (``anchors``), reused while the queries stay alike."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.anchors: dict[int, Anchor] = {}

    def slots(self, layer: int, q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, tokens: int) -> torch.Tensor:
        """The slots layer ``layer``'s rows ``q [n, H, d]`` read besides the sinks and the window,
        ``[tokens]``: the anchor's while its query is alike and its slots lie in ``lo .. hi`` (and
        number ``tokens``), else a new vote over ``keys [H_kv, L, d]``."""
        query = q.float().reshape(q.shape[0], -1).mean(0)  # [H*d]
        anchor = self.anchors.get(layer)
        if (anchor is not None and len(anchor.positions) == tokens and int(anchor.positions[0]) >= lo
                and int(anchor.positions[-1]) < hi
                and float(torch.nn.functional.cosine_similarity(query, anchor.query, dim=0)) >= self.threshold):
            return anchor.positions
        chosen = vote(q, keys, lo, hi, tokens)
        self.anchors[layer] = Anchor(query, chosen)
        return chosen
