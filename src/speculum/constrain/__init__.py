"""Structured output: constraints compiled by llguidance, applied to every node of a draft tree.

- :mod:`.spec`: what the output must match (JSON schema, JSON object, regex, choice, Lark grammar).
- :mod:`.matcher`: a compiled :class:`Grammar` (:func:`compile_constraint` builds and caches them)
  and a request's :class:`TokenMatcher`, which prunes draft trees, masks the verifier's logits node
  by node and offers forced tokens as free drafts;
- :mod:`.guide`: the one object the engine asks, per step, to shape the tree, mask the logits,
  close the output within its budget and advance on what was committed.
- :mod:`.hf_processor`: the same constraint as a transformers ``LogitsProcessor`` (the baseline).
- :mod:`.exact`, :mod:`.asap`, :mod:`.awrs`: sampled requests that follow the model's distribution
  over whole outputs conditioned on the grammar instead of masking step by step
  (``Grammar(..., sampling="asap" | "awrs")``).
"""

from .guide import UNGUIDED, Guide
from .matcher import (
    Grammar,
    TokenMatcher,
    compile_constraint,
    ll_tokenizer,
    mask_logits,
    restrict_draft_probs,
)
from .request_guide import guide_for
from .spec import KINDS, ConstraintSpec, pick_constraint

__all__ = ["KINDS", "UNGUIDED", "ConstraintSpec", "Grammar", "Guide", "TokenMatcher", "compile_constraint",
           "guide_for", "ll_tokenizer", "mask_logits", "pick_constraint", "restrict_draft_probs"]
