"""The native runner: a compact decoder for Llama-family and Gemma-3 weights with a static KV cache,
tree attention and CUDA-graph steps on GPU (see :mod:`speculum.native.model`)."""

from .cache import StaticKVCache
from .model import NativeDecoder, unsupported_reason
from .runner import NativeRunner

__all__ = ["NativeDecoder", "NativeRunner", "StaticKVCache", "unsupported_reason"]
