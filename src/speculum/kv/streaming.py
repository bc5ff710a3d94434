"""``streaming``: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks"): keep the first few tokens, which soak up attention whatever they say (the
sinks), and a window of the most recent ones. Positions are numbered inside the cache, as in the
paper: a token's rotary position is its slot, and keys move to their new slots when older tokens
are evicted (:class:`~speculum.cache.PositionedKVCache`'s rolling positions), so a model streams
past its context length with its positions always inside it. Cheap and stable, blind to content:
what lies in the middle of a long prompt is gone, so retrieval from there fails.

Example, budget 8 with 4 sinks, after 20 tokens ``t0 .. t19`` and one eviction: the cache holds
``t0 t1 t2 t3 t16 t17 t18 t19`` at positions 0..7, and the next token is fed at position 8.
"""

from __future__ import annotations

import torch

from .eviction import EvictionPolicy


class StreamingPolicy(EvictionPolicy):
    """Attention sinks + recent window, at prefill and while decoding.

    ``rolling=False`` (``streaming:rolling=0``) keeps each token's position in the text instead of
    its slot (speculum's earlier variant): the sequence is then bounded by the model's context.
    """

    name = "streaming"

    def __init__(self, budget="0.25", sinks: int = 4, rolling=True):
        super().__init__(budget)
        self.sinks = int(sinks)
        self.rolling = str(rolling).lower() not in ("0", "false", "no")

    def _slots(self, n: int, m: int, heads: int, device) -> torch.Tensor:
        s = min(self.sinks, m)
        idx = torch.cat([torch.arange(s, device=device), torch.arange(n - (m - s), n, device=device)])
        return idx.expand(heads, m)

    def select_prefill(self, kv, scores, m):
        return self._slots(kv.shape[2], m, kv.shape[1], kv.device)

    def select_decode(self, cache, layer, budget):
        return self._slots(cache.length, budget, cache.layout.kv_heads, cache.device)
