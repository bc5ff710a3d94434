"""KV-cache policies: what the cache stores and what each decode step reads.

===================  ====================================================================================
``full``             no policy: the whole cache, full attention (the baseline)
*eviction*
``streaming``        StreamingLLM: attention sinks + recent window, positions rolled inside the cache (evicts)
``h2o``              H2O: heavy hitters by accumulated attention + recent window (evicts)
``keyformer``        Keyformer: key tokens by accumulated Gumbel-softmax scores + recent window (evicts)
``d2o``              D2O: H2O's eviction, each evicted token merged into its most similar kept one (evicts)
``snapkv``           SnapKV: the prompt's last tokens vote for what to keep, pooled (evicts at prefill)
``pyramidkv``        PyramidKV: SnapKV's votes, per-layer budgets falling linearly with depth (evicts at prefill)
``cake``             CAKE: per-layer budgets by attention dispersion, split in cascade as layers prefill (evicts at prefill)
``adakv``            Ada-KV: SnapKV's votes, a layer's budget split over its KV heads by joint top-k (evicts at prefill)
``chelsea``          Chelsea: the prompt's chunks clustered, one merged entry per cluster (merges at prefill)
``duo``              DuoAttention: learned gates; retrieval heads keep all, streaming heads sinks + window
*compression of what is kept*
``kv_quant``         KIVI: keys per channel, values per token, 2 or 4 bits, recent tokens in full precision
``gear``             GEAR: KIVI's codes + a low-rank approximation of their error + exact outliers
``zipcache``         ZipCache: salient tokens (normalized attention) at 4 bits, the others at 2
``think``            ThinK: the prompt's keys keep the channels its last queries weigh most (optionally after SnapKV)
*sparse reads (the whole cache stored, a budget of it read per step)*
``tidal``            TidalDecode: sparse reads of the top-k tokens chosen in selection layers
``quest``            Quest: sparse reads of the pages with the best key-bound scores
``double_sparsity``  Double Sparsity: top-k tokens by label-channel scores (a small label cache)
``tokenselect``      TokenSelect: top-k tokens by head-soft-voted q.k, Selection Cache reuse
``squeezed``         Squeezed Attention: prompt keys clustered at prefill, the matching clusters read
``recycled``         Recycled Attention: full attention every ``stride`` positions, its top-k recycled in between
``hip``              HiP: hierarchical top-k over key blocks judged by representative keys
``shadowkv``         ShadowKV: keys stored low-rank before RoPE, the chunks with the best landmarks rebuilt and read
===================  ====================================================================================

Speculation under a lossy policy gives what plain decoding under it gives where the policy allows:
policies that decide at prefill only (ThinK too) are unaffected by how tokens are grouped into
steps; those that evict while decoding stop each step's tree at their next decision point
(:meth:`KVPolicy.draft_depth`); the quantizers with a full-precision window (KIVI, GEAR, ZipCache)
let each row of a tree read the groups a one-token step at its position would already have
quantized (:mod:`speculum.cache.window`); the last six sparse-read policies decide per query row
(:mod:`speculum.kv.rows`; ShadowKV its own way), so a tree step reads for each row what a
one-token step at its position would (up to floating-point rounding, as without a policy).

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
