"""ASAp: Adaptive Sampling with Approximate expected futures.

Park, Zhou, Hwang, Shen, Li, D'Antoni (2024), "Grammar-Aligned Decoding",
https://arxiv.org/abs/2405.21047

The rule. The exact constrained distribution samples token ``x`` after prefix ``w`` with probability
``p(x | w) * EFG(w x) / EFG(w)``, where ``EFG(w) = sum_x p(x | w) * EFG(w x)`` is the *expected future
grammaticality* of ``w``: the probability that the model, continuing ``w``, produces an output the
grammar accepts (``EFG = 1`` for a complete output, after its end token). EFG is unknown; ASAp keeps,
per prompt and grammar, a trie of the prefixes its samples went through, with each visited prefix's
distribution over legal tokens ``p(x | w) * allowed(x)``, and approximates

    EFG(w x) ~= sum_y p(y | w x) * allowed(y) * EFG(w x y)   where ``w x`` was visited,
    EFG(w x) ~= 1                                            where it was not (the grammar allows it),

recomputed bottom-up along each new sample's path. Every step samples from ``p * allowed * EFG``
renormalised. The first sample is plain grammar-constrained decoding; as samples accumulate the
estimates become exact on the prefixes that matter and the samples follow ``p(y | y in grammar)``.
Each sample is drawn with the estimates as they stood when it started; the trie learns from it at each
commit.

Worked example: ``p(a) = 0.9, p(b) = 0.1`` at the start; after ``a`` the grammar allows only ``c``
with ``p(c | a) = 0.1`` (then the end), after ``b`` only the end with ``p(end | b) = 1``. Masking gives
``P(ac) = 0.9`` and ``P(b) = 0.1``; the exact distribution is ``P(ac) = 0.09 / 0.19 = 0.47`` and
``P(b) = 0.53``. ASAp's first sample is drawn like masking; once ``a`` has been visited its estimate
is ``EFG(a) = 0.1`` (and ``EFG(b) = 1``), so the next samples draw ``a`` with probability
``0.9 * 0.1 / (0.9 * 0.1 + 0.1 * 1) = 0.47``: exact.

In speculum. :class:`AsapGuide` is an :class:`~speculum.constrain.exact.ExactGuide` whose row weights
are the trie's estimates for the children of the row's prefix, so it composes with every drafter: the
tree is pruned to legal tokens and verified against the reweighted rows. The trie lives on the compiled
:class:`~speculum.constrain.matcher.Grammar`, one per (prompt, sampling parameters, model), the last
:data:`ASAP_TRIES` kept, each at most :data:`ASAP_NODES` prefixes (past that the trie stops growing
and its estimates stay approximate). Greedy requests use plain masking: ASAp is a sampling method.
The paper's implementation stores the full next-token distribution per prefix; this one stores only
the legal tokens with non-zero ``p`` (sparse), which is all the EFG sums read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from .exact import ExactGuide
from .matcher import Grammar

ASAP_TRIES = 32  # tries kept per grammar (least recently used dropped)
ASAP_NODES = 50_000  # prefixes kept per trie


@dataclass
class AsapNode:
    """A visited prefix ``w``: its legal tokens' probabilities and its children's EFG estimates."""

    tokens: torch.Tensor  # [k] int64 legal tokens with p > 0
    probs: torch.Tensor  # [k] float64 p(x | w) of those tokens (not renormalised)
    efg: dict[int, float] = field(default_factory=dict)  # child token -> EFG(w x); missing: 1

    def expected_future(self) -> float:
        """``EFG(w) ~= sum_x p(x | w) * EFG(w x)`` from the current child estimates."""
        total = float(self.probs.sum())
        for tok, est in self.efg.items():
            hit = (self.tokens == tok).nonzero()
            if len(hit):
                total += float(self.probs[hit[0, 0]]) * (est - 1.0)
        return total


class AsapTrie:
    """Visited output prefixes (tuples of token ids, the prompt excluded) -> :class:`AsapNode`."""

    def __init__(self, max_nodes: int = ASAP_NODES):
        self.nodes: dict[tuple[int, ...], AsapNode] = {}
        self.max_nodes = max_nodes
        self.lock = threading.Lock()

    def weights(self, prefix: tuple[int, ...], width: int) -> torch.Tensor | None:
        """``[V]`` the EFG estimates of ``prefix``'s children (1 where unvisited), or None if none known."""
        node = self.nodes.get(prefix)
        if node is None or not node.efg:
            return None
        w = torch.ones(width, dtype=torch.float32)
        for tok, est in node.efg.items():
            w[tok] = est
        return w

    def observe(self, prefix: tuple[int, ...], legal_p: torch.Tensor) -> None:
        """Store ``prefix``'s legal distribution ``[V]`` (``p * allowed``) unless already known or full."""
        if prefix in self.nodes or len(self.nodes) >= self.max_nodes:
            return
        tokens = legal_p.nonzero()[:, 0]
        self.nodes[prefix] = AsapNode(tokens, legal_p[tokens].double())

    def update(self, path: tuple[int, ...], end_ids: set[int]) -> None:
        """Recompute the EFG estimates bottom-up along ``path`` (a sample's output so far)."""
        for j in range(len(path) - 1, -1, -1):
            node = self.nodes.get(path[:j])
            if node is None:
                continue
            tok = path[j]
            if tok in end_ids:
                continue  # the output is complete: EFG = 1, the default
            child = self.nodes.get(path[: j + 1])
            if child is not None:
                node.efg[tok] = child.expected_future()


class AsapGuide(ExactGuide):
    """ASAp's guide: rows sample from ``p * allowed * EFG-estimates`` (see the module docstring)."""

    def __init__(self, grammar: Grammar, width: int, params: SamplingParams, trie: AsapTrie):
        super().__init__(grammar, width, params)
        self.trie = trie

    def row_prefixes(self) -> list[tuple[int, ...]]:
        """``[n + 1]`` the output prefix each row of ``[root] + tree`` predicts after."""
        base = tuple(self.generated)
        out = [base]
        for tok, parent in zip(self.tree.tokens, self.tree.parents):
            out.append(out[parent + 1] + (tok,))
        return out

    def reweight(self, legal_p: torch.Tensor) -> torch.Tensor | None:
        with self.trie.lock:
            rows = [self.trie.weights(p, legal_p.shape[-1]) for p in self.row_prefixes()]
        if all(r is None for r in rows):
            return None
        ones = torch.ones(legal_p.shape[-1])
        return torch.stack([ones if r is None else r for r in rows]).to(legal_p.device)

    def commit(self, tokens: list[int]) -> None:
        rows = self.committed_rows(tokens)
        prefixes = self.row_prefixes()
        with self.trie.lock:
            for row in rows:
                self.trie.observe(prefixes[row], self.legal_p[row].cpu())
            super().commit(tokens)
            self.trie.update(tuple(self.generated), self.matcher.eos_ids)


def asap_trie(grammar: Grammar, key: tuple) -> AsapTrie:
    """The grammar's ASAp trie for ``key`` (prompt, sampling parameters, model), made on first use."""
    with grammar.lock:
        tries: OrderedDict = grammar.asap_tries
        trie = tries.get(key)
        if trie is None:
            trie = tries[key] = AsapTrie()
            while len(tries) > ASAP_TRIES:
                tries.popitem(last=False)
        tries.move_to_end(key)
        return trie
