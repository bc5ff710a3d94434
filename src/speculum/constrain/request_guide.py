"""The guide of a request: plain masking, or ASAp's or AWRS's exact constrained sampling."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .asap import AsapGuide, asap_trie
from .awrs import AwrsGuide
from .guide import UNGUIDED, Guide, Unguided
from .matcher import Grammar


def guide_for(grammar: Grammar | None, width: int, params: SamplingParams | None = None,
              generator: torch.Generator | None = None, key: tuple = ()) -> Unguided:
    """The request's guide: :data:`UNGUIDED` for None; for a grammar, :class:`Guide` (masking), or for
    a sampled request under the grammar's ``sampling`` ``"asap"`` / ``"awrs"`` their guides (``key``:
    what identifies the request's distribution for ASAp's trie: prompt, parameters, model;
    ``generator``: AWRS's random numbers)."""
    if grammar is None:
        return UNGUIDED
    if params is None or params.greedy or grammar.sampling == "mask":
        return Guide(grammar, width)
    if grammar.sampling == "asap":
        return AsapGuide(grammar, width, params, asap_trie(grammar, (key, params)))
    return AwrsGuide(grammar, width, params, generator if generator is not None else torch.Generator())

