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
  by their path's draft probability for the engine's tree sizer. Sampled requests draft a chain.

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
                 top_k: int = 1, max_nodes: int = 24, min_path_prob: float = 0.02, stop_risk: float | None = None):
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
        return self._chain(tokens[-1], k)

    def _chain(self, last: int, k: int) -> DraftTree:
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        deciles: list[int] = []
        survive = 1.0  # predicted probability that every token drafted so far is accepted
        for _ in range(k):
            logits = self.runner.forward_tree(self.cache, last, DraftTree())[-1]  # [V]
            self.cache.commit()
            self.seen.append(last)
            if self.params.greedy:
                probs = torch.softmax(logits.float(), -1)
                nxt = int(probs.max(-1).indices)
            else:
                probs = self.params.probs(logits)
                nxt = int(torch.multinomial(probs, 1, generator=self.generator))
                qs.append(probs)
            drafted.append(nxt)
            deciles.append(min(int(float(probs[nxt]) * 10), 9))
            last = nxt
            if nxt in self.end_ids:  # nothing after it can be committed
                break
            if self.stop_risk is not None:
                survive *= self.rates.p(deciles[-1])
                if 1.0 - survive > self.stop_risk:
                    break
        tree = DraftTree.chain(drafted, torch.stack(qs) if qs else None)
        tree.tags = [("dm", d) for d in deciles]
        return tree

    def _tree(self, root: int, depth: int, budget: int) -> DraftTree:
        """EAGLE-2's dynamic tree from the draft model: one forward per depth over the root and the
        nodes expanded so far (each row sees its ancestors); the draft cache keeps only the root."""
        grow = DynamicTree(self.top_k, self.min_path_prob, self.end_ids)
        logits = self.runner.forward_tree(self.cache, root, DraftTree())  # [1, V]
        level = grow.add_children([-1], torch.log_softmax(logits.float(), -1))

        def expand(frontier: list[int], _e: int) -> torch.Tensor:
            fed: set[int] = set()
            for node in frontier:  # the frontier and its ancestors, in creation (topological) order
                while node >= 0 and node not in fed:
                    fed.add(node)
                    node = grow.parents[node]
            order = sorted(fed)
            row = {node: r for r, node in enumerate(order)}
            sub = DraftTree([grow.tokens[i] for i in order],
                            [row[grow.parents[i]] if grow.parents[i] >= 0 else -1 for i in order])
            out = self.runner.forward_tree(self.cache, root, sub)  # [1 + len(sub), V]
            rows = torch.tensor([1 + row[node] for node in frontier], device=out.device)
            return torch.log_softmax(out.index_select(0, rows).float(), -1)

        grow.grow(level, depth - 1, expand)
        self.cache.commit([0])  # the root's entry; the nodes' are overwritten next time
        self.seen.append(root)
        return grow.result(min(self.max_nodes, budget))

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
