"""Running estimates of how often drafted nodes match the target, by feature.

Drafters attach to each node a score, the estimated probability that it is accepted, for the
engine's :class:`~speculum.tree_sizing.TreeSizer`. A score is the product of conditional hit
rates along the node's path; each conditional rate is learnt online here, keyed by whatever
features the drafter has (depth and candidate rank for Token Recycling, match length and
continuation frequency for suffix decoding). A node *hits* when its token equals the target's
argmax after its parent's path, whether or not the parent itself was accepted, so every verified
node teaches something. Old observations decay so that the estimates follow the text.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..tree import DraftTree
from ..verify import Acceptance, greedy_tokens


class HitRates:
    """Per-key hit rate with a prior: ``(hits + w * prior) / (trials + w)``, decayed by ``decay`` per record."""

    def __init__(self, prior: float | dict = 0.3, weight: float = 4.0, decay: float = 0.998):
        self.prior, self.weight, self.decay = prior, weight, decay
        self.stats: dict[Hashable, list[float]] = {}  # key -> [hits, trials]

    def _prior(self, key: Hashable) -> float:
        return self.prior(key) if callable(self.prior) else self.prior

    def p(self, key: Hashable) -> float:
        s = self.stats.get(key)
        hits, trials = (0.0, 0.0) if s is None else s
        return (hits + self.weight * self._prior(key)) / (trials + self.weight)

    def record(self, key: Hashable, hit: bool) -> None:
        s = self.stats.setdefault(key, [0.0, 0.0])
        s[0] = s[0] * self.decay + float(hit)
        s[1] = s[1] * self.decay + 1.0


def node_hits(tree: DraftTree, logits: torch.Tensor, acceptance: Acceptance) -> list[bool | None]:
    """``[n]``: for each node whose parent was accepted or is the root, whether its token is the
    target's argmax there; ``None`` for untested nodes."""
    target = acceptance.target if acceptance.target is not None else greedy_tokens(logits)  # [n + 1]
    ok = set(acceptance.path)
    return [tok == target[p + 1] if (p < 0 or p in ok) else None for tok, p in zip(tree.tokens, tree.parents)]


def record_tree(rates: HitRates, source: str, tree: DraftTree, logits: torch.Tensor,
                acceptance: Acceptance) -> None:
    """Record the tested nodes of ``tree`` tagged ``(source, key)`` in ``rates``."""
    if tree.tags is None or not any(t is not None and t[0] == source for t in tree.tags):
        return
    for tag, hit in zip(tree.tags, node_hits(tree, logits, acceptance)):
        if hit is not None and tag is not None and tag[0] == source:
            rates.record(tag[1], hit)
