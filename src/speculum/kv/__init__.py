"""KV-cache policies: what the cache stores and what each decode step reads.

=============  ====================================================================================
``full``       no policy: the whole cache, full attention (the baseline)
``streaming``  StreamingLLM: attention sinks + recent window, positions rolled inside the cache (evicts)
``h2o``        H2O: heavy hitters by accumulated attention + recent window (evicts)
``snapkv``     SnapKV: the prompt's last tokens vote for what to keep, pooled (evicts at prefill)
``kv_quant``   KIVI: keys per channel, values per token, 2 or 4 bits, recent tokens in full precision
``tidal``      TidalDecode: full cache, sparse reads of the top-k tokens chosen in selection layers
``quest``      Quest: full cache, sparse reads of the pages with the best key-bound scores
``duo``        DuoAttention: learned gates; retrieval heads keep all, streaming heads sinks + window
=============  ====================================================================================

A policy is named on the command line as ``name`` or ``name:option=value,...`` (for example
``tidal:layers=6+14``, ``kv_quant:bits=2``, ``quest:page=32``); the budget (tokens or a ratio of
the prompt) is given separately. See :func:`make_policy`.
"""

from __future__ import annotations

from ..errors import SpeculumError
from ..options import parse_named
from .base import Budget, KVPolicy
from .duo_attention import DuoAttentionPolicy
from .h2o import H2OPolicy
from .kv_quant import KVQuantPolicy
from .quest import QuestPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy
from .tidal import TidalPolicy

# the registry: a policy is one file and one line here
POLICIES: dict[str, type[KVPolicy]] = {
    "streaming": StreamingPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "kv_quant": KVQuantPolicy,
    "tidal": TidalPolicy,
    "quest": QuestPolicy,
    "duo": DuoAttentionPolicy,
}
POLICY_NAMES = ("full",) + tuple(POLICIES)


def make_policy(spec: str, budget="0.25") -> KVPolicy | None:
    """``"snapkv"``, ``"tidal:layers=2+12"``, ... -> a policy (None for ``"full"``)."""
    name, kwargs = parse_named(spec, "KV policy")
    if name == "full":
        return None
    if name not in POLICIES:
        raise SpeculumError(f"unknown KV policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    try:
        return POLICIES[name](budget, **kwargs)
    except (TypeError, ValueError) as e:
        raise SpeculumError(f"bad option for KV policy {name!r}: {e}") from None


__all__ = ["POLICIES", "POLICY_NAMES", "Budget", "KVPolicy", "make_policy"]
