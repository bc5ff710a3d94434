"""KV-cache policies: what the cache stores and what each decode step reads.

===================  ====================================================================================
``full``             no policy: the whole cache, full attention (the baseline)
``streaming``        StreamingLLM: attention sinks + recent window, positions rolled inside the cache (evicts)
``h2o``              H2O: heavy hitters by accumulated attention + recent window (evicts)
``snapkv``           SnapKV: the prompt's last tokens vote for what to keep, pooled (evicts at prefill)
``pyramidkv``        PyramidKV: SnapKV's votes, per-layer budgets falling linearly with depth (evicts at prefill)
``cake``             CAKE: per-layer budgets by attention dispersion, split in cascade as layers prefill (evicts at prefill)
``adakv``            Ada-KV: SnapKV's votes, a layer's budget split over its KV heads by joint top-k (evicts at prefill)
``kv_quant``         KIVI: keys per channel, values per token, 2 or 4 bits, recent tokens in full precision
``tidal``            TidalDecode: full cache, sparse reads of the top-k tokens chosen in selection layers
``quest``            Quest: full cache, sparse reads of the pages with the best key-bound scores
``double_sparsity``  Double Sparsity: full cache, top-k tokens by label-channel scores (a small label cache)
``tokenselect``      TokenSelect: full cache, top-k tokens by head-soft-voted q.k, Selection Cache reuse
``squeezed``         Squeezed Attention: full cache, prompt keys clustered at prefill, the matching clusters read
``recycled``         Recycled Attention: full attention every ``stride`` positions, its top-k recycled in between
``hip``              HiP: full cache, hierarchical top-k over key blocks judged by representative keys
===================  ====================================================================================

The last five decide per query row (:mod:`speculum.kv.rows`): a tree step reads for each row what a
one-token step at its position would, so speculation under them gives what plain decoding under them
gives, whatever the budget (up to floating-point rounding, as without a policy).

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
from .double_sparsity import DoubleSparsityPolicy
from .h2o import H2OPolicy
from .hip import HiPPolicy
from .kv_quant import KVQuantPolicy
from .pyramidkv import PyramidKVPolicy
from .quest import QuestPolicy
from .recycled import RecycledPolicy
from .snapkv import SnapKVPolicy
from .squeezed import SqueezedPolicy
from .streaming import StreamingPolicy
from .tidal import TidalPolicy
from .tokenselect import TokenSelectPolicy

# the registry: a policy is one file and one line here
POLICIES: dict[str, type[KVPolicy]] = {
    "streaming": StreamingPolicy,
    "h2o": H2OPolicy,
    "snapkv": SnapKVPolicy,
    "pyramidkv": PyramidKVPolicy,
    "cake": CakePolicy,
    "adakv": AdaKVPolicy,
    "kv_quant": KVQuantPolicy,
    "tidal": TidalPolicy,
    "quest": QuestPolicy,
    "double_sparsity": DoubleSparsityPolicy,
    "tokenselect": TokenSelectPolicy,
    "squeezed": SqueezedPolicy,
    "recycled": RecycledPolicy,
    "hip": HiPPolicy,
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
