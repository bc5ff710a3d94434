"""Many requests at once: continuous batching (:mod:`.scheduler`) and shared-prefix reuse
(:mod:`.prefix_cache`)."""

from .prefix_cache import PrefixCache
from .scheduler import Batcher, BatchRequest

__all__ = ["BatchRequest", "Batcher", "PrefixCache"]
