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
  committed tokens are distributed exactly as plain sampling from p. Row ``i`` of ``draft_probs``
  must be the distribution node ``i`` was drawn from given its earlier siblings: q itself for
  i.i.d. siblings, q without the earlier siblings (renormalized) for siblings drawn without
  replacement, which makes this loop Recursive Speculative Decoding's (Jeon et al. 2024; ``stand``).
- Keyed sampling (the default for sampled requests whose drafts are point masses, i.e. every
  model-free drafter but ``stand``): the token at sequence position ``t`` is p_t's inverse CDF at ``u_t``, a
  uniform number that is a hash of ``(key, t)`` (the key is the request's seed). That is exactly a
  sample from p_t, like Gumbel-max with noise keyed by ``(key, t)`` but with one number per
  position instead of ``V``. Verification is the greedy walk on those samples. A drafted token x
  is accepted with probability p(x), as under rejection sampling, but the output no longer
  depends on the tree: the same seed gives the same text whatever the drafter proposed or learnt
  before, and the same text as ``ar``. Decisions read ``u`` of positions up to the bonus token
  only, so every later position's ``u`` is still unused when its token is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree


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


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a 64-bit integer hash with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(key: int, position: int) -> float:
    """A uniform number in ``[0, 1)`` that is a pure function of ``(key, position)`` (53 bits of a
    SplitMix64 hash): every verification step, tree shape or method that samples sequence position
    ``position`` of the request keyed ``key`` draws the same number."""
    return (_splitmix64(_splitmix64(key & _MASK64) ^ position) >> 11) * 2.0 ** -53


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds ``u`` (``probs`` ``[V]``, ``u`` in [0, 1)).

    Zero-probability tokens have empty intervals and are never returned.
    """
    cdf = probs.double().cumsum(0)  # [V]
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device),
                                 right=True))
    if idx >= probs.shape[0]:  # u * total rounded up to the total: the last token with mass
        idx = int(torch.nonzero(probs > 0)[-1])
    return idx


class Verifier:
    """Greedy, keyed-sampling or rejection-sampling acceptance of a draft tree.

    Args:
        params: the sampling parameters (temperature 0: greedy).
        generator: the request's random numbers, for rejection sampling (None when greedy).
        key: the request's key for keyed sampling (its seed, or a random one); None turns
            keyed sampling off and every sampled tree goes through rejection sampling.
    """

    keyed = True  # sample point-mass trees by keyed inverse CDF (False: rejection sampling for all)
    name = "specinfer"  # the rule's name (``--verify``); see :mod:`speculum.verify.rules`
    siblings = "iid"  # how a sampled tree's siblings must be drawn for this rule (DraftTree.siblings)
    lossy = False  # whether the rule may commit other text than plain decoding would (judge decoding)
    hidden_layers: tuple[int, ...] = ()  # target hidden states the rule reads (accept's ``hidden``)

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None, key: int | None = None):
        self.params = params
        self.generator = generator
        self.key = key

    def accept(self, tree: DraftTree, logits: torch.Tensor, position: int | None = None,
               hidden: dict[int, torch.Tensor] | None = None) -> Acceptance:
        """``logits``: ``[n + 1, V]`` target logits for ``[root] + tree.tokens``; ``position``: the
        sequence position that row 0 predicts (the committed length), needed by keyed sampling;
        ``hidden``: the forward's hidden states ``{layer: [n + 1, D]}`` of :attr:`hidden_layers`."""
        if self.params.greedy:
            return self.accept_greedy(tree, logits)
        if self.keyed and self.key is not None and position is not None and tree.draft_probs is None:
            return self.accept_keyed(tree, logits, position)
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

    def keyed_token(self, probs: torch.Tensor, position: int) -> int:
        """The sampled token at ``position`` (``probs`` ``[V]``): inverse CDF at the keyed uniform."""
        return inverse_cdf(probs, position_uniform(self.key, position))

    def accept_keyed(self, tree: DraftTree, logits: torch.Tensor, position: int) -> Acceptance:
        """Greedy walk on the keyed samples of each row on the path (rows off it are never drawn)."""
        kids = tree.children()
        path, row, depth = [], 0, 0
        while True:
            target = self.keyed_token(self.params.probs(logits[row]), position + depth)
            match = next((c for c in kids[row] if tree.tokens[c] == target), None)
            if match is None:
                return Acceptance(path, [tree.tokens[i] for i in path] + [target])
            path.append(match)
            row, depth = match + 1, depth + 1

    def accept_sampled(self, tree: DraftTree, logits: torch.Tensor) -> Acceptance:
        self.check_siblings(tree)
        probs = self.params.probs(logits)  # [n + 1, V] float32
        kids = tree.children()
        path, row = [], 0
        while True:
            accepted, p = self.pick_child(tree, kids[row], probs[row])
            if accepted is None:
                bonus = int(torch.multinomial(p, 1, generator=self.generator).item())
                return Acceptance(path, [tree.tokens[i] for i in path] + [bonus])
            path.append(accepted)
            row = accepted + 1

    def pick_child(self, tree: DraftTree, children: list[int], p: torch.Tensor) -> tuple[int | None, torch.Tensor]:
        """SpecInfer's rule at one node (target ``p`` ``[V]``): the accepted child, or None and the
        distribution ``[V]`` to sample the bonus token from (the residual after every rejection)."""
        for c in children:
            x = tree.tokens[c]
            q = self._draft_dist(tree, c, p)
            ratio = (p[x] / q[x]).item()
            if self._uniform() < ratio:
                return c, p
            p = self.residual(p, q)
        return None, p

    def check_siblings(self, tree: DraftTree) -> None:
        """Raise unless the tree's sampled siblings were drawn the way this rule is exact for
        (:attr:`siblings`); a node with at most one child is a chain step, exact under every rule."""
        if tree.draft_probs is None or tree.siblings == self.siblings:
            return
        if any(len(k) > 1 for k in tree.children()):
            raise RuntimeError(f"{type(self).__name__} is exact for siblings drawn {self.siblings!r}, but the drafter "
                               f"drew them {tree.siblings!r} (a drafter must draw as Drafter.siblings says)")

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
