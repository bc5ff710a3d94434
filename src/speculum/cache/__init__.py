"""KV caches: one base (:class:`KVCache`: growth, commit of an accepted path, rollback, bytes) and the
caches that extend it.

- :class:`StaticKVCache`: one ``[layers, 2, H_kv, C, d]`` buffer (every runner's plain cache);
- :class:`PositionedKVCache`: a static cache whose slots remember their positions (eviction and
  sparse-read KV policies; rolling positions for StreamingLLM);
- :class:`QuantKVCache`: packed 2/4-bit entries plus a full-precision window (KIVI);
- :class:`SplitHeadCache`: KV heads in groups that keep every entry or only sinks and a recent
  window (DuoAttention's retrieval and streaming heads);
- :class:`SlotPool` / :class:`SlotCache`: many sequences' static caches in one buffer (batching).
"""

from .base import KVCache
from .pool import SlotCache, SlotPool
from .positioned import PositionedKVCache
from .quantized import QuantKVCache
from .split import GroupSpec, SplitHeadCache
from .static import StaticKVCache

__all__ = ["GroupSpec", "KVCache", "PositionedKVCache", "QuantKVCache", "SlotCache", "SlotPool", "SplitHeadCache",
           "StaticKVCache"]
