"""``streaming``: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks"): keep the first few tokens, which soak up attention whatever they say (the
sinks), and a window of the most recent ones. Cheap and stable, blind to content: what lies in
the middle of a long prompt is gone, so retrieval from there fails."""

from __future__ import annotations

import torch

from .eviction import EvictionPolicy


class StreamingPolicy(EvictionPolicy):
    """Attention sinks + recent window, at prefill and while decoding."""

    name = "streaming"

    def __init__(self, budget="0.25", sinks: int = 4):
        super().__init__(budget)
        self.sinks = int(sinks)

    def _slots(self, n: int, m: int, heads: int, device) -> torch.Tensor:
        s = min(self.sinks, m)
        idx = torch.cat([torch.arange(s, device=device), torch.arange(n - (m - s), n, device=device)])
        return idx.expand(heads, m)

    def select_prefill(self, kv, scores, m):
        return self._slots(kv.shape[2], m, kv.shape[1], kv.device)

    def select_decode(self, cache, layer, budget):
        return self._slots(cache.length, budget, cache.shape.kv_heads, cache.device)
