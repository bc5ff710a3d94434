"""KV caches: one base (:class:`KVCache`: growth, commit of an accepted path, rollback, bytes) and the
caches that extend it.

- :class:`StaticKVCache`: one ``[layers, 2, H_kv, C, d]`` buffer (every runner's plain cache);
- :class:`PositionedKVCache`: a static cache whose slots remember their positions (eviction and
  sparse-read KV policies; rolling positions for StreamingLLM);
- :class:`RaggedKVCache`: per-layer buffers, each sized to what its layer keeps, heads of a layer
  padded to its longest (budget-allocation policies: PyramidKV, CAKE, AdaKV);
- :class:`MergedKVCache`: a positioned cache whose slots may hold merged clusters of tokens, read
  with a ``log`` cluster-size attention bias (Chelsea);
- :class:`QuantKVCache`: packed 2/4-bit entries plus a full-precision window (KIVI), on the
  residual-window layout of :mod:`.window` that GEAR (:mod:`.gear`: low-rank and sparse
  corrections per chunk) and ZipCache (:mod:`.mixed`: mixed precision by saliency) share;
- :mod:`.pruned`: a positioned cache whose older prompt keys keep chosen channels (ThinK);
- :mod:`.shadow`: a positioned cache plus low-rank pre-RoPE prompt keys read back by chunk (ShadowKV);
- :class:`SplitHeadCache`: KV heads in groups that keep every entry or only sinks and a recent
  window (DuoAttention's retrieval and streaming heads);
- :class:`SlotPool` / :class:`SlotCache`: many sequences' static caches in one buffer (batching).
"""

from .base import KVCache
from .merged import MergedKVCache
from .pool import SlotCache, SlotPool
from .positioned import PositionedKVCache
from .quantized import QuantKVCache
from .ragged import RaggedKVCache
from .split import GroupSpec, SplitHeadCache
from .static import StaticKVCache

__all__ = ["GroupSpec", "KVCache", "MergedKVCache", "PositionedKVCache", "QuantKVCache", "RaggedKVCache", "SlotCache", "SlotPool",
           "SplitHeadCache", "StaticKVCache"]
