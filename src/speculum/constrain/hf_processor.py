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

    def __init__(self, grammar: Grammar, prompt_len: int, max_new_tokens: int | None = None):
        self.matcher = grammar.matcher()
        self.prompt_len = self.seen = prompt_len  # tokens of input_ids already consumed by the matcher
        self.reserve = grammar.close_reserve if max_new_tokens is not None else 0
        self.max_new_tokens = max_new_tokens
        self.closed = False  # the budget closer took over (see Grammar's close_reserve)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise ValueError("GrammarLogitsProcessor supports batch size 1")
        new = input_ids[0, self.seen:].tolist()
        self.matcher.commit(new)
        self.seen = input_ids.shape[1]
        allowed = self.matcher.allowed(DraftTree())  # [1, V]
        remaining = None if not self.reserve else self.max_new_tokens - (self.seen - self.prompt_len)
        if remaining is not None and remaining <= self.reserve:
            path = self.matcher.closing_due(remaining)
            if path is not None:  # the closer's next token only: the same rule, token by token
                self.closed = True
                allowed = torch.zeros_like(allowed)
                allowed[0, path[0]] = True
        width = scores.shape[-1]
        return mask_logits(scores, allowed[:, :width])
