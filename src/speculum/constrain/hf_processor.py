"""A transformers ``LogitsProcessor`` that applies a :class:`~speculum.constrain.matcher.Grammar`:
the reference that constrained speculum methods are compared against (``hf`` with a grammar).

It is the usual one-token-at-a-time integration: at each ``generate`` step it consumes the token
sampled last, computes the mask for the next one and sets forbidden logits to ``-inf``.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..tree import DraftTree
from .matcher import Grammar, mask_logits


class GrammarLogitsProcessor(LogitsProcessor):
    """Batch size 1; build a new processor per ``generate`` call (it holds the request's state)."""

    def __init__(self, grammar: Grammar, prompt_len: int):
        self.matcher = grammar.matcher()
        self.seen = prompt_len  # tokens of input_ids already consumed by the matcher (the prompt)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise ValueError("GrammarLogitsProcessor supports batch size 1")
        new = input_ids[0, self.seen:].tolist()
        self.matcher.commit(new)
        self.seen = input_ids.shape[1]
        allowed = self.matcher.allowed(DraftTree())  # [1, V]
        width = scores.shape[-1]
        return mask_logits(scores, allowed[:, :width])
