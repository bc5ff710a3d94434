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

from dataclasses import dataclass, field, replace

import numpy as np
import torch

SIBLING_DRAWS = ("iid", "without_replacement")  # how a sampled tree's siblings were drawn (DraftTree.siblings)


@dataclass
class PromptRows:
    """Rows a drafter hangs into the verification forward that are not drafted tokens: trained
    input embeddings after tree nodes (PPD's prompt tokens), whose outputs the drafter reads after
    the step (:meth:`~speculum.drafters.base.Drafter.see_prompt_logits`). Never verified, never kept
    in the KV cache.

    Row ``r`` follows node ``anchors[r]`` (``-1``: the root) at position ``offsets[r]`` past it, sees
    that node's ancestors and the node itself, and the rows ``among[r]`` allows (itself included);
    tree rows never see prompt rows.
    """

    anchors: list[int]  # [e]
    offsets: list[int]  # [e] >= 1
    embeds: torch.Tensor  # [e, D] input embeddings (what the first layer reads)
    among: np.ndarray  # [e, e] bool

    def __len__(self) -> int:
        return len(self.anchors)

    def kept(self, new_index: dict[int, int]) -> PromptRows | None:
        """The rows whose anchors survive a renumbering of the nodes (``old -> new``; the root stays)."""
        rows = [r for r, a in enumerate(self.anchors) if a < 0 or a in new_index]
        if not rows:
            return None
        anchors = [a if a < 0 else new_index[a] for a in (self.anchors[r] for r in rows)]
        return PromptRows(anchors, [self.offsets[r] for r in rows], self.embeds[rows], self.among[np.ix_(rows, rows)])


@dataclass
class DraftTree:
    """A drafted token tree.

    Attributes:
        tokens: ``[n]`` drafted token ids.
        parents: ``[n]`` parent node index, ``-1`` for children of the root.
        draft_probs: ``[n, V]`` float32 or ``None``. Row ``i`` is the distribution that node ``i``'s
            token was sampled from (the drafter's q at the parent's position). ``None`` means the
            drafter is deterministic: q is a point mass on each drafted token.
        scores: ``[n]`` or ``None``: the drafter's estimate of the probability that node ``i`` is
            accepted (its whole root path matches). Never larger than the parent's score. The
            engine's tree sizer keeps the best-scoring nodes that pay for their verification cost.
        tags: ``[n]`` or ``None``: opaque per-node data for the drafter (e.g. the features it
            learns hit rates by); kept through :meth:`subtree` so the drafter can read it in
            ``update`` after the engine trimmed the tree.
        prompts: :class:`PromptRows` to run beside the tree in the same forward, or ``None``; kept
            through :meth:`subtree` for the nodes kept.
        siblings: how sampled siblings (children of one node, in node order) were drawn from their
            shared ``draft_probs`` row, which each of them carries: ``"iid"`` (independently: SpecInfer's
            and SpecTr's drafts) or ``"without_replacement"`` (sibling ``j`` from q with siblings
            ``0..j-1``'s tokens removed and renormalized, e.g. Gumbel-top-k: Recursive Speculative
            Decoding's drafts). Only read when ``draft_probs`` is set; see :mod:`speculum.verify_rules`.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    scores: list[float] | None = None
    tags: list | None = None
    prompts: PromptRows | None = None
    siblings: str = "iid"

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError("scores needs one entry per node")
        if self.siblings not in SIBLING_DRAWS:
            raise ValueError(f"siblings must be one of {SIBLING_DRAWS}, got {self.siblings!r}")

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
        mask = torch.from_numpy(self.ancestor_mask_np())
        return mask.to(device) if device is not None else mask

    def ancestor_mask_np(self) -> np.ndarray:
        """:meth:`ancestor_mask` as a numpy array (built in numpy: a row copy per node costs well
        under a microsecond there, against several for a torch op)."""
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return mask

    def cut_after(self, ends: set[int] | frozenset[int]) -> DraftTree:
        """The tree without the descendants of nodes whose token is in ``ends`` (a request's EOS ids:
        what follows one can never be committed); the tree itself where there are none."""
        if not ends or not any(t in ends for t in self.tokens):
            return self
        dead: list[bool] = []
        for i, p in enumerate(self.parents):  # creation order is topological
            dead.append(p >= 0 and (dead[p] or self.tokens[p] in ends))
        return self.subtree([i for i, d in enumerate(dead) if not d])

    def within_depth(self, depth: int) -> DraftTree:
        """The tree without nodes deeper than ``depth`` (0: empty); the tree itself where none is."""
        depths = self.depths()
        if not depths or max(depths) <= depth:
            return self
        return self.subtree([i for i, d in enumerate(depths) if d <= depth])

    def subtree(self, keep: list[int]) -> DraftTree:
        """The tree restricted to nodes ``keep`` (increasing, closed under taking parents)."""
        new_index = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            p = self.parents[old]
            if p >= 0 and p not in new_index:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(-1 if p < 0 else new_index[p])
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        scores = None if self.scores is None else [self.scores[i] for i in keep]
        tags = None if self.tags is None else [self.tags[i] for i in keep]
        prompts = None if self.prompts is None else self.prompts.kept(new_index)
        return DraftTree([self.tokens[i] for i in keep], parents, probs, scores, tags, prompts, self.siblings)

    def with_probs(self, draft_probs: torch.Tensor | None) -> DraftTree:
        """This tree with other draft probabilities (everything else shared)."""
        return replace(self, draft_probs=draft_probs)

    def forward_mask(self) -> np.ndarray:
        """``[n + 1 + e, n + 1 + e]`` bool visibility of the verification forward's rows: the
        :meth:`ancestor_mask` of ``[root] + tokens``, then the prompt rows (each sees its anchor's
        row of the ancestor mask, its anchor, and the prompt rows ``among`` allows)."""
        tree = self.ancestor_mask_np()
        if self.prompts is None:
            return tree
        n1, e = tree.shape[0], len(self.prompts)
        mask = np.zeros((n1 + e, n1 + e), dtype=bool)
        mask[:n1, :n1] = tree
        rows = [a + 1 for a in self.prompts.anchors]
        mask[n1:, :n1] = tree[rows]
        mask[n1:, n1:] = self.prompts.among
        return mask

    def forward_positions(self) -> list[int]:
        """Position offsets (from the root's) of the forward's rows: ``[0] + depths``, then each
        prompt row's anchor depth plus its offset."""
        depths = [0] + self.depths()
        if self.prompts is None:
            return depths
        return depths + [depths[a + 1] + o for a, o in zip(self.prompts.anchors, self.prompts.offsets)]

    def best_chain(self) -> DraftTree:
        """The tree cut to one root path: the path with the largest sum of ``scores`` (the expected
        number of accepted tokens along it), or, without scores, the first child at every level."""
        if self.is_chain:
            return self
        if self.scores is not None:
            gain: list[float] = []
            for i, p in enumerate(self.parents):
                gain.append(self.scores[i] + (gain[p] if p >= 0 else 0.0))
            leaf = max(range(len(self)), key=gain.__getitem__)
        else:
            kids, leaf, row = self.children(), -1, 0
            while kids[row]:
                leaf = kids[row][0]
                row = leaf + 1
        return self.subtree(self.path_to(leaf))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


class TreeBuilder:
    """Builds a :class:`DraftTree` from candidate continuations, merging shared prefixes.

    ``add(parent, token, score)`` returns the node for ``token`` under ``parent`` (``-1`` = root),
    creating it or raising its score to the larger of the two (two sources proposing the same
    token strengthen it). Nodes are numbered in creation order, parents first.
    """

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.tags: list = []
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, tag=None) -> int:
        key = (parent, token)
        node = self._index.get(key)
        if node is None:
            node = len(self.tokens)
            self._index[key] = node
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(score)
            self.tags.append(tag)
        elif score > self.scores[node]:
            self.scores[node] = score
            self.tags[node] = tag
        return node

    def add_path(self, tokens: list[int], scores: list[float], parent: int = -1) -> int:
        """Add a chain below ``parent``; returns the last node (``parent`` for an empty chain)."""
        for tok, sc in zip(tokens, scores):
            parent = self.add(parent, tok, sc)
        return parent

    def child(self, parent: int, token: int) -> int | None:
        return self._index.get((parent, token))

    def build(self) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents), None, list(self.scores), list(self.tags))
