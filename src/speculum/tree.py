"""Draft trees: what a drafter proposes and the verifier checks in one forward pass.

A tree of ``n`` drafted nodes hangs below the *root*, the last committed token (whose KV entry
is not yet cached). Node ``i`` carries a token and its parent's index, ``-1`` for the root.
Nodes are stored in topological order (a parent before its children). A chain of ``k`` tokens
is the tree ``parents = [-1, 0, 1, ..., k-2]``; plain decoding is the empty tree.

Example: root "The", draft "cat sat" and "dog": tokens=[cat, sat, dog], parents=[-1, 0, -1],
depth=[1, 2, 1]. The verification forward feeds ``[root] + tokens`` at positions
``L + [0] + depth`` (``L`` = committed length) under the ancestor mask below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """A drafted token tree.

    Attributes:
        tokens: ``[n]`` drafted token ids.
        parents: ``[n]`` parent node index, ``-1`` for children of the root.
        draft_probs: ``[n, V]`` float32 or ``None``. Row ``i`` is the distribution that node ``i``'s
            token was sampled from (the drafter's q at the parent's position). ``None`` means the
            drafter is deterministic: q is a point mass on each drafted token.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """``[n]`` depth of each node; children of the root have depth 1."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def children(self) -> list[list[int]]:
        """``[n + 1]`` lists of child node indices; entry 0 is the root's, entry ``i+1`` node i's."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def ancestor_mask(self, device=None) -> torch.Tensor:
        """``[n + 1, n + 1]`` bool: row ``a`` may attend column ``b`` (b is a or an ancestor of a).

        Index 0 is the root, index ``i + 1`` is node ``i``.
        """
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask.to(device) if device is not None else mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
