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
        """``max_new_tokens``: the budget, for the grammar's budget closer (greedy decoding only: its
        rule looks at the model's argmax token); None leaves the closer off."""
        self.matcher = grammar.matcher()
        self.prompt_len = self.seen = prompt_len  # tokens of input_ids already consumed by the matcher
        self.reserve = grammar.close_reserve if max_new_tokens is not None else 0
        self.max_new_tokens = max_new_tokens
        self.closing: list[int] = []  # the rest of the closer's completion, once it took over
        self.closed = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise ValueError("GrammarLogitsProcessor supports batch size 1")
        new = input_ids[0, self.seen:].tolist()
        self.matcher.commit(new)
        self.seen = input_ids.shape[1]
        width = scores.shape[-1]
        masked = mask_logits(scores, self.matcher.allowed(DraftTree())[:, :width])  # [1, V]
        left = None if not self.reserve else self.max_new_tokens - (self.seen - self.prompt_len)
        if not self.closing and left is not None and left <= self.reserve:
            path = self.matcher.closing_instead(int(masked[0].argmax()), left)
            if path is not None:  # the same rule as the engine's (see Grammar's close_reserve)
                self.closing, self.closed = path, True
        if self.closing:
            forced = torch.full_like(masked, float("-inf"))
            forced[0, self.closing.pop(0)] = 0.0
            return forced
        return masked
