"""Verification: which drafted tokens the target model accepts, and the bonus token after them.

Input to :meth:`Verifier.accept` is the tree and the target's logits ``[n + 1, V]`` for
``[root] + tree.tokens``: row 0 predicts the token after the root, row ``i + 1`` the token after
node ``i``.

- Greedy (temperature 0): walk down from the root, at each node taking the child whose token is
  the target's argmax; stop where no child matches and emit the argmax there as the bonus token.
  The output is exactly plain greedy decoding's.
- Sampling: lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023), in its
  multi-draft form (SpecInfer, Miao et al. 2024). At a node with target distribution p, try its
  children in order: child token x drafted from q is accepted with probability
  ``min(1, p(x) / q(x))``; on rejection p becomes the residual ``norm(max(0, p - q))`` and the next
  child is tried. When no child is accepted the bonus token is sampled from the (residual) p.
  A deterministic drafter has ``q`` = a point mass on its token, so acceptance is ``p(x)`` and
  the residual is p with x removed. For a chain this is exactly Leviathan/Chen's rule; the
  committed tokens are distributed exactly as plain sampling from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams
from .tree import DraftTree


@dataclass
class Acceptance:
    """Outcome of one verification.

    Attributes:
        path: accepted node indices, root's child first (``[]`` when nothing was accepted).
        tokens: accepted drafted tokens followed by the bonus token (``len(path) + 1`` ids).
    """

    path: list[int]
    tokens: list[int]
    target: list[int] | None = None  # [n + 1] argmax of each logits row, when the verifier computed it


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``[n + 1]`` argmax of each row of ``logits`` ``[n + 1, V]``.

    ``max(-1).indices`` returns the first maximal index like ``argmax`` does, and is faster than
    ``argmax`` on bfloat16 CPU tensors (BENCHMARKS.md, "Why the defaults").
    """
    return logits.max(-1).indices.tolist()


class Verifier:
    """Greedy or lossless-sampling acceptance of a draft tree, depending on ``params``."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None):
        self.params = params
        self.generator = generator

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> Acceptance:
        """``logits``: ``[n + 1, V]`` target logits for ``[root] + tree.tokens``."""
        if self.params.greedy:
            return self.accept_greedy(tree, logits)
        return self.accept_sampled(tree, logits)

    def accept_greedy(self, tree: DraftTree, logits: torch.Tensor) -> Acceptance:
        target = greedy_tokens(logits)  # [n + 1]
        if tree.is_chain:  # fast path: longest matching prefix
            path = []
            for i, tok in enumerate(tree.tokens):
                if tok != target[i]:
                    break
                path.append(i)
            return Acceptance(path, [tree.tokens[i] for i in path] + [target[len(path)]], target)
        kids = tree.children()
        path, row = [], 0
        while True:
            match = next((c for c in kids[row] if tree.tokens[c] == target[row]), None)
            if match is None:
                break
            path.append(match)
            row = match + 1
        return Acceptance(path, [tree.tokens[i] for i in path] + [target[row]], target)

    def accept_sampled(self, tree: DraftTree, logits: torch.Tensor) -> Acceptance:
        probs = self.params.probs(logits)  # [n + 1, V] float32
        kids = tree.children()
        path, row = [], 0
        while True:
            p = probs[row]
            accepted = None
            for c in kids[row]:
                x = tree.tokens[c]
                q = self._draft_dist(tree, c, p)
                ratio = (p[x] / q[x]).item()
                if self._uniform() < ratio:
                    accepted = c
                    break
                p = self.residual(p, q)
            if accepted is None:
                bonus = int(torch.multinomial(p, 1, generator=self.generator).item())
                return Acceptance(path, [tree.tokens[i] for i in path] + [bonus])
            path.append(accepted)
            row = accepted + 1

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``norm(max(0, p - q))``: the distribution to sample from after rejecting a draft from q."""
        r = (p - q).clamp_min(0)
        total = r.sum()
        # total == 0 only if p <= q everywhere, i.e. p == q, where rejection has probability 0.
        return r / total if total > 0 else p

    @staticmethod
    def _draft_dist(tree: DraftTree, node: int, like: torch.Tensor) -> torch.Tensor:
        if tree.draft_probs is not None:
            return tree.draft_probs[node].to(like.device, torch.float32)
        q = torch.zeros_like(like)
        q[tree.tokens[node]] = 1.0
        return q

    def _uniform(self) -> float:
        return float(torch.rand((), generator=self.generator).item())
