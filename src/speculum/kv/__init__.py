"""KV-cache policies: what the cache stores and what each decode step reads.

===================  =============================================================================
A policy is named on the command line as ``name`` or ``name:option=value,...`` (for example
``tidal:layers=6+14``, ``kv_quant:bits=2``, ``quest:page=32``); the budget (tokens or a ratio of
the prompt) is given separately. See :func:`make_policy`.
"""

from __future__ import annotations

from ..errors import SpeculumError
from ..options import parse_named
from .adakv import AdaKVPolicy
from .base import Budget, KVPolicy
from .cake import CakePolicy
from .chelsea import ChelseaPolicy
from .d2o import D2OPolicy
from .double_sparsity import DoubleSparsityPolicy
from .duo_attention import DuoAttentionPolicy
from .gear import GearPolicy
from .h2o import H2OPolicy
from .hip import HiPPolicy
from .keyformer import KeyformerPolicy
from .kv_quant import KVQuantPolicy
from .pyramidkv import PyramidKVPolicy
from .quest import QuestPolicy
from .recycled import RecycledPolicy
from .shadowkv import ShadowKVPolicy
from .snapkv import SnapKVPolicy
from .squeezed import SqueezedPolicy
from .streaming import StreamingPolicy
from .think import ThinKPolicy
from .tidal import TidalPolicy
from .tokenselect import TokenSelectPolicy
from .zipcache import ZipCachePolicy

# the registry: a policy is one file and one line here
POLICIES: dict[str, type[KVPolicy]] = {
    "streaming": StreamingPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "pyramidkv": PyramidKVPolicy,
    "cake": CakePolicy,
    "adakv": AdaKVPolicy,
    "kv_quant": KVQuantPolicy,
    "gear": GearPolicy,
    "zipcache": ZipCachePolicy,
    "think": ThinKPolicy,
    "tidal": TidalPolicy,
    "quest": QuestPolicy,
    "keyformer": KeyformerPolicy,
    "d2o": D2OPolicy,
    "chelsea": ChelseaPolicy,
    "double_sparsity": DoubleSparsityPolicy,
    "tokenselect": TokenSelectPolicy,
    "squeezed": SqueezedPolicy,
    "recycled": RecycledPolicy,
    "hip": HiPPolicy,
    "shadowkv": ShadowKVPolicy,
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
