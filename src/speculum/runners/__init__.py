"""Runners: what turns token ids into logits (and hidden states) against a KV cache.

- :mod:`.base`: the :class:`Runner` protocol, its :class:`Forward` result, and the one prefill
  loop and forward prologue every runner shares;
- :mod:`.hf`: :class:`HFRunner`, any transformers causal LM through its own modules;
- :mod:`.native`: :class:`NativeRunner`, speculum's decoder (:mod:`.decoder`) for Llama-family and
  Gemma-3 weights, with CUDA-graph steps on a GPU (:mod:`.graphs`);
- :mod:`.policy`: :class:`PolicyRunner`, a native runner with a KV policy plugged in (layer-by-layer
  prefill: :mod:`.layerwise`);
- :mod:`.select`: :func:`runner_for` (built once per model and kind), :func:`use_runner` and
  :func:`release_model_weights`.
"""

from .base import Forward, Runner, RunnerBase, layer_types
from .decoder import NativeDecoder, unsupported_reason
from .hf import HFRunner
from .native import NativeRunner
from .packed import packed_linear
from .policy import PolicyRunner, under_policy
from .select import (
                     RUNNER_KINDS,
                     release_if_native,
                     release_model_weights,
                     runner_for,
                     use_runner,
                     weights_released,
)

__all__ = ["RUNNER_KINDS", "Forward", "HFRunner", "NativeDecoder", "NativeRunner", "PolicyRunner", "Runner",
           "RunnerBase", "layer_types", "packed_linear", "release_if_native", "release_model_weights", "runner_for", "under_policy",
           "unsupported_reason",
           "use_runner", "weights_released"]
