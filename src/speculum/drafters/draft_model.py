"""``draft_model``: a smaller causal LM with the target's tokenizer drafts a chain or a tree (SpS:
Leviathan et al. 2023, Chen et al. 2023; trees as SpecInfer's and EAGLE-2's; SpecDec++'s
adaptive length, Huang et al. 2024).

The draft model has its own runner and KV cache. Each step it catches up on the tokens it has not
seen (the bonus token, and any accepted tokens it did not draft itself), then drafts:

- **a chain** (``top_k=1``): ``k`` tokens one at a time, argmax under greedy decoding, otherwise
  sampled from its own distribution q (the engine's temperature / top-k / top-p applied to its
  logits), q being attached to the tree so the verifier can accept with ``min(1, p/q)``;
- **a tree** (``top_k > 1``, greedy requests): EAGLE-2's dynamic tree
  (:mod:`~speculum.drafting.tree_growth`) over ``depth`` depths, each depth one forward of the
  draft model over the root and the nodes being expanded (with their ancestors), the nodes scored
  by their path's draft probability for the engine's tree sizer;
- **a sampled tree** (``top_k > 1``, sampled requests, ``sampled_tree=True``): the same growth, but
  each node's ``top_k`` children are *drawn* from q without replacement, with the q each was drawn
  from (:mod:`~speculum.drafting.sampled_tree`), so that the verifier's multi-draft rule accepts
  more than one chain would and stays exact. It carries no scores (the sizer must not trim it).
  ``sampled_tree=False`` drafts a sampled chain instead.

**How long a chain** (``stop_risk``, SpecDec++'s rule): drafting stops once the predicted
probability that at least one drafted token gets rejected exceeds ``stop_risk``. SpecDec++ trains
a head on the draft's hidden states to predict each token's acceptance; here the prediction is
the draft's own probability of the token, calibrated online (hit rates by probability decile,
learnt from every verification). ``stop_risk=None`` keeps the older rule: ``k`` grows by one after
a fully accepted chain and falls to one past the accepted length otherwise (``adaptive``).

The draft cache is rolled back to the longest prefix shared with the committed sequence, so
rejected drafts cost nothing afterwards.
"""

from __future__ import annotations

import torch

from ..drafting.sampled_tree import grow_sampled_tree
from ..drafting.tree_growth import DynamicTree
from ..errors import SpeculumError
from ..runners import runner_for
from ..tree import DraftTree
from ..verify import Acceptance
from .base import Drafter
from .hit_rates import HitRates, record_tree


def same_tokenizer(target_tokenizer, draft_tokenizer) -> bool:
    """Whether both tokenizers map the same strings to the same ids (True when either is unknown)."""
    return (target_tokenizer is None or draft_tokenizer is None
            or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab())


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Raise :class:`SpeculumError` unless both tokenizers map the same strings to the same ids."""
    if not same_tokenizer(target_tokenizer, draft_tokenizer):
        raise SpeculumError(
            "the draft model's tokenizer differs from the target's: draft_model needs a shared vocabulary "
            "(use hf_assisted for transformers' universal assisted decoding)"
        )


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, draft_model: torch.nn.Module, num_draft: int = 4, adaptive: bool = True,
                 top_k: int = 1, max_nodes: int = 24, min_path_prob: float = 0.02, stop_risk: float | None = None,
                 sampled_tree: bool = True):
        if num_draft < 1 or top_k < 1 or max_nodes < 1:
            raise SpeculumError(f"draft_model needs num_draft, top_k and max_nodes >= 1; got {num_draft}, {top_k}, "
                                f"{max_nodes}")
        if stop_risk is not None and not 0.0 < stop_risk < 1.0:
            raise SpeculumError(f"draft_model's stop_risk is a probability in (0, 1); got {stop_risk}")
        self.model = draft_model  # runners do not keep their model alive
        self.runner = runner_for(draft_model)
        self.max_draft = num_draft
        self.adaptive = adaptive
        self.top_k, self.max_nodes, self.min_path_prob, self.stop_risk = top_k, max_nodes, min_path_prob, stop_risk
        self.sampled_tree = sampled_tree
        # P(a drafted token is accepted | its draft probability's decile), shared across requests
        self.rates = HitRates(prior=lambda decile: (decile + 0.5) / 10)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.cache = self.runner.new_cache(len(prompt_ids) + 256)
        self.seen: list[int] = []  # tokens whose KV entries are committed in self.cache
        self.k = self.max_draft

    def _sync(self, tokens: list[int]) -> None:
        """Roll the draft cache back to the prefix it shares with ``tokens[:-1]`` and prefill the rest."""
        common = 0
        limit = min(len(self.seen), len(tokens) - 1)
        while common < limit and self.seen[common] == tokens[common]:
            common += 1
        self.cache.rollback(common)
        del self.seen[common:]
        missing = tokens[common:-1]
        if missing:
            self.runner.prefill(self.cache, missing)
            self.seen.extend(missing)

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        k = min(self.k if self.stop_risk is None else self.max_draft, budget)
        if k <= 0:
            return DraftTree()
        self._sync(tokens)
        if self.top_k > 1 and self.params.greedy:
            return self._tree(tokens[-1], k, budget)
        if self.top_k > 1 and self.sampled_tree:
            return self._sampled_tree(tokens[-1], k, budget)
        return self._chain(tokens[-1], k)

    def _next_logits(self, last: int) -> torch.Tensor:
        """``[V]`` the draft's logits after ``last``, whose KV entry is committed to the draft cache."""
        logits = self.runner.forward_tree(self.cache, last, DraftTree())[-1]
        self.cache.commit()
        self.seen.append(last)
        return logits

    def _falls_back(self, probs: torch.Tensor) -> bool:
        """Whether the chain ends before drafting from ``probs`` ``[V]`` (none here; BiLD's fallback)."""
        return False

    def _stops_after(self, probs: torch.Tensor, token: int) -> bool:
        """Whether the chain ends after drafting ``token`` from ``probs`` ``[V]``: SpecDec++'s rule on
        the calibrated draft probability where ``stop_risk`` is set (:attr:`survive` is the predicted
        probability that every token drafted so far is accepted)."""
        if self.stop_risk is None:
            return False
        self.survive *= self.rates.p(min(int(float(probs[token]) * 10), 9))
        return 1.0 - self.survive > self.stop_risk

    def _chain(self, last: int, k: int) -> DraftTree:
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        deciles: list[int] = []
        self.survive = 1.0
        for _ in range(k):
            logits = self._next_logits(last)  # [V]
            if self.params.greedy:
                probs = torch.softmax(logits.float(), -1)
            else:
                probs = self.params.probs(logits)
            if self._falls_back(probs):
                break
            if self.params.greedy:
                nxt = int(probs.max(-1).indices)
            else:
                nxt = int(torch.multinomial(probs, 1, generator=self.generator))
                qs.append(probs)
            drafted.append(nxt)
            deciles.append(min(int(float(probs[nxt]) * 10), 9))
            last = nxt
            if nxt in self.end_ids:  # nothing after it can be committed
                break
            if self._stops_after(probs, nxt):
                break
        tree = DraftTree.chain(drafted, torch.stack(qs) if qs else None)
        tree.tags = [("dm", d) for d in deciles]
        return tree

    def _expand(self, root: int, tokens: list[int], parents: list[int], frontier: list[int]) -> torch.Tensor:
        """``[m, V]`` the draft's logits after each of the ``frontier`` nodes of a tree being grown
        (``tokens``, ``parents``): one forward over the root and the frontier with its ancestors
        (each row sees its ancestors), left pending in the draft cache."""
        fed: set[int] = set()
        for node in frontier:  # the frontier and its ancestors, in creation (topological) order
            while node >= 0 and node not in fed:
                fed.add(node)
                node = parents[node]
        order = sorted(fed)
        row = {node: r for r, node in enumerate(order)}
        sub = DraftTree([tokens[i] for i in order], [row[parents[i]] if parents[i] >= 0 else -1 for i in order])
        out = self.runner.forward_tree(self.cache, root, sub)  # [1 + len(sub), V]
        rows = torch.tensor([1 + row[node] for node in frontier], device=out.device)
        return out.index_select(0, rows)

    def _tree(self, root: int, depth: int, budget: int) -> DraftTree:
        """EAGLE-2's dynamic tree from the draft model: one forward per depth over the root and the
        nodes expanded so far (each row sees its ancestors); the draft cache keeps only the root."""
        grow = DynamicTree(self.top_k, self.min_path_prob, self.end_ids)
        logits = self.runner.forward_tree(self.cache, root, DraftTree())  # [1, V]
        level = grow.add_children([-1], torch.log_softmax(logits.float(), -1))

        def expand(frontier: list[int], _e: int) -> torch.Tensor:
            return torch.log_softmax(self._expand(root, grow.tokens, grow.parents, frontier).float(), -1)

        grow.grow(level, depth - 1, expand)
        self.cache.commit([0])  # the root's entry; the nodes' are overwritten next time
        self.seen.append(root)
        return grow.result(min(self.max_nodes, budget))

    def _sampled_tree(self, root: int, depth: int, budget: int) -> DraftTree:
        """A tree whose nodes are drawn from the draft's q (:mod:`~speculum.drafting.sampled_tree`),
        ``top_k`` distinct children per expanded node; the draft cache keeps only the root."""
        logits = self.runner.forward_tree(self.cache, root, DraftTree())[-1]  # [V]

        def expand(tokens: list[int], parents: list[int], frontier: list[int]) -> torch.Tensor:
            return self.params.probs(self._expand(root, tokens, parents, frontier))

        tree = grow_sampled_tree(self.params.probs(logits), depth, self.top_k, min(self.max_nodes, budget),
                                 self.generator, expand, self.end_ids)
        self.cache.commit([0])
        self.seen.append(root)
        return tree

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if len(tree) == 0:
            return
        record_tree(self.rates, "dm", tree, logits, acceptance)
        if not self.adaptive or self.stop_risk is not None or not tree.is_chain:
            return
        if len(acceptance.path) == len(tree):
            self.k = min(self.max_draft, self.k + 1)
        else:
            self.k = max(1, len(acceptance.path) + 1)
