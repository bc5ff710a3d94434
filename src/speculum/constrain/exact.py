"""What ASAp (:mod:`.asap`) and AWRS (:mod:`.awrs`) share: a guide that samples from the model's own
sampling distribution restricted to the grammar, reweighted row by row.

Plain masking (:class:`~speculum.constrain.guide.Guide`) sets forbidden logits to ``-inf`` and then
applies temperature, top-k and top-p: each step samples ``p(x | prefix, x legal)``. Over whole outputs
that is not ``p(output | output in the grammar)``: a prefix whose legal continuations the model finds
unlikely keeps the mass the model gave it. The exact target is

    P(y) = prod_t p(y_t | y_<t) / Z    over the complete outputs y the grammar accepts,

with ``p`` the request's sampling distribution (temperature, top-k and top-p of the raw logits).

:class:`ExactGuide` makes every verified row sample from ``p * allowed * w`` renormalised, where ``w``
``[n + 1, V]`` is a method's reweighting (ASAp: its estimates of each continuation's future
grammaticality; AWRS: none, it weights whole outputs instead). The verifier then runs at temperature 1
without filters (:meth:`ExactGuide.verifier_params`) on ``log(p * allowed * w)``, so speculation stays
lossless with respect to that reweighted distribution: the tree is pruned to legal tokens as with
masking, and any drafter composes.

It records, per step, each row's legal mass ``Z_row = sum(p * allowed)`` ``[n + 1]`` and the rows the
committed tokens came from (:meth:`ExactGuide.committed_rows`).

Where ``p`` gives every legal token zero mass (top-k or top-p cut them all) the target is undefined at
that prefix; the row falls back to plain masking of the raw logits so that decoding can go on.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree
from .guide import Guide
from .matcher import Grammar


class ExactGuide(Guide):
    """A guide whose rows sample from ``p * allowed * w`` (see the module docstring).

    Args:
        grammar, width: as :class:`~speculum.constrain.guide.Guide`.
        params: the request's sampling parameters (what ``p`` is).
    """

    def __init__(self, grammar: Grammar, width: int, params: SamplingParams):
        super().__init__(grammar, width)
        self.params = params
        self.tree = DraftTree([], [])
        self.generated: list[int] = []  # the output committed so far
        self.legal_p: torch.Tensor | None = None  # [n + 1, V] p * allowed of the last verified tree
        self.mass: torch.Tensor | None = None  # [n + 1] legal mass of each row

    def verifier_params(self, params: SamplingParams) -> SamplingParams:
        """The verifier samples the rows :meth:`mask` returns as they are: temperature 1, no filters."""
        return replace(params, temperature=1.0, top_k=0, top_p=1.0)

    def bind(self, tree: DraftTree) -> DraftTree:
        self.tree = tree
        return super().bind(tree)

    def reweight(self, legal_p: torch.Tensor) -> torch.Tensor | None:
        """``[n + 1, V]`` factors for the rows of ``[root] + tree`` (None: all ones)."""
        return None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``log(p * allowed * w)`` ``[n + 1, V]``; rows with no legal mass fall back to masking."""
        allowed = self.allowed.to(logits.device)
        legal_p = self.params.probs(logits) * allowed  # [n + 1, V]
        self.legal_p, self.mass = legal_p, legal_p.sum(-1)
        w = self.reweight(legal_p)
        q = legal_p if w is None else legal_p * w
        out = q.log()
        empty = q.sum(-1) <= 0  # [n + 1]
        if bool(empty.any()):
            out[empty] = logits[empty].float().masked_fill(~allowed[empty], float("-inf"))
        return out

    def committed_rows(self, tokens: list[int]) -> list[int]:
        """The rows of ``[root] + tree`` that predicted ``tokens`` (a step's committed tokens): the root,
        then the accepted path's nodes; shorter than ``tokens`` where they leave the tree's rows (the
        budget closer's completion)."""
        kids = self.tree.children()
        rows, row = [], 0
        for tok in tokens:
            rows.append(row)
            nxt = [c for c in kids[row] if self.tree.tokens[c] == tok]
            if not nxt:
                break
            row = nxt[0] + 1
        return rows[: len(tokens)]

    def commit(self, tokens: list[int]) -> None:
        super().commit(tokens)
        self.generated += tokens
