"""One request's constraint, as the decoding loop uses it: the engine's only entry into ``constrain/``.

Per step, in the engine's order:

1. :meth:`Guide.shape` puts the tokens the grammar forces at the head of the drafted tree
   (jump-forward: they are verified for free) and prunes the drafted tokens it forbids;
2. the engine's tree sizer trims the tree;
3. :meth:`Guide.bind` computes the tokens allowed after the root and after every node of the final
   tree, and restricts sampled drafts' distributions to them (so that verification stays lossless);
4. :meth:`Guide.mask` sets forbidden logits to ``-inf`` before verification;
5. :meth:`Guide.close` applies the budget closer to the verified tokens (see
   :class:`~speculum.constrain.matcher.Grammar`'s ``close_reserve``);
6. :meth:`Guide.commit` advances the grammar over what was committed.

Without a constraint :data:`UNGUIDED` does nothing at each of those points, so the loop has no
special case. ``forced`` and ``mask_s`` report the last step's forced tokens and grammar time.
"""

from __future__ import annotations

import time

import torch

from ..errors import SpeculumError
from ..sampling import SamplingParams
from ..tree import DraftTree
from .matcher import Grammar, graft_forced, mask_logits, restrict_draft_probs


class Unguided:
    """No constraint: every step passes through unchanged."""

    forced = 0
    mask_s = 0.0

    def shape(self, tree: DraftTree, room: int) -> DraftTree:
        return tree

    def verifier_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters the verifier samples :meth:`mask`'s rows with (the request's, here)."""
        return params

    def bind(self, tree: DraftTree) -> DraftTree:
        return tree

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def close(self, tokens: list[int], left: int) -> tuple[list[int], bool]:
        return tokens, False

    def commit(self, tokens: list[int]) -> None:
        pass


UNGUIDED = Unguided()


class Guide(Unguided):
    """A grammar's state for one request (see the module docstring for when each method runs)."""

    def __init__(self, grammar: Grammar, width: int):
        if grammar.width != width:
            raise SpeculumError(f"the grammar was compiled for logits {grammar.width} wide, the model's are {width}")
        self.grammar = grammar
        self.matcher = grammar.matcher()
        self.allowed: torch.Tensor | None = None  # [n + 1, V] bool for the tree being verified
        self.forced, self.mask_s = 0, 0.0

    def shape(self, tree: DraftTree, room: int) -> DraftTree:
        """The forced tokens (up to ``room``) with ``tree`` grafted below them, illegal nodes pruned."""
        t0 = time.perf_counter()
        forced = self.matcher.forced(room)
        self.forced = len(forced)
        if forced:
            tree = graft_forced(forced, tree, room)
        tree = self.matcher.prune(tree)
        self.mask_s = time.perf_counter() - t0
        return tree

    def bind(self, tree: DraftTree) -> DraftTree:
        """Compute the allowed tokens of every row of ``[root] + tree`` and restrict draft q to them."""
        t0 = time.perf_counter()
        self.allowed = self.matcher.allowed(tree)  # [n + 1, V]
        tree = restrict_draft_probs(tree, self.allowed)
        self.mask_s += time.perf_counter() - t0
        return tree

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return mask_logits(logits, self.allowed)

    def close(self, tokens: list[int], left: int) -> tuple[list[int], bool]:
        """The budget closer over the verified ``tokens`` with ``left`` tokens of budget before them:
        ``(tokens to commit, whether the grammar's completion replaced the model's tail)``."""
        reserve = self.grammar.close_reserve
        if not reserve:
            return tokens, False
        t0 = time.perf_counter()
        checked = max(0, len(tokens) - max(0, left - reserve))  # the tokens in the closer's zone
        found = self.matcher.close_within(tokens, left, checked) if checked else None
        self.mask_s += time.perf_counter() - t0
        if found is None:
            return tokens, False
        return tokens[:found[0]] + found[1], True

    def commit(self, tokens: list[int]) -> None:
        self.matcher.commit(tokens)

