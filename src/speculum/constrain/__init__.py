"""Structured output: constraints compiled by llguidance, applied to every node of a draft tree.

- :mod:`.spec`: what the output must match (JSON schema, JSON object, regex, choice, Lark grammar).
- :mod:`.matcher`: a compiled :class:`Grammar` and a request's :class:`TokenMatcher`, which prunes
  draft trees, masks the verifier's logits node by node and offers forced tokens as free drafts.
- :mod:`.hf_processor`: the same constraint as a transformers ``LogitsProcessor`` (the baseline).
"""

from .matcher import Grammar, TokenMatcher, mask_logits, restrict_draft_probs
from .spec import KINDS, ConstraintSpec

__all__ = ["KINDS", "ConstraintSpec", "Grammar", "TokenMatcher", "mask_logits", "restrict_draft_probs"]
