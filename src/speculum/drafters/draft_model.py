"""``draft_model``: a smaller causal LM with the target's tokenizer drafts a chain (SpS: Leviathan
et al. 2023, Chen et al. 2023).

The draft model has its own runner and KV cache. Each step it catches up on the tokens it has not
seen (the bonus token, and any accepted tokens it did not draft itself), then drafts ``k`` tokens
one at a time: argmax under greedy decoding, otherwise sampled from its own distribution q
(the engine's temperature / top-k / top-p applied to its logits), q being attached to the tree so
the verifier can accept with ``min(1, p/q)``. Its cache is rolled back to the longest prefix
shared with the committed sequence, so rejected drafts cost nothing afterwards.
"""

from __future__ import annotations

import torch

from ..errors import SpeculumError
from ..runners import runner_for
from ..tree import DraftTree
from ..verify import Acceptance
from .base import Drafter


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

    def __init__(self, draft_model: torch.nn.Module, num_draft: int = 4, adaptive: bool = True):
        self.model = draft_model  # runners do not keep their model alive
        self.runner = runner_for(draft_model)
        self.max_draft = num_draft
        self.adaptive = adaptive

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

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        k = min(self.k, budget)
        if k <= 0:
            return DraftTree()
        self._sync(tokens)
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        last = tokens[-1]
        for _ in range(k):
            logits = self.runner.forward_tree(self.cache, last, DraftTree())[-1]  # [V]
            self.cache.commit()
            self.seen.append(last)
            if self.params.greedy:
                nxt = int(logits.max(-1).indices)
            else:
                q = self.params.probs(logits)
                nxt = int(torch.multinomial(q, 1, generator=self.generator))
                qs.append(q)
            drafted.append(nxt)
            last = nxt
        return DraftTree.chain(drafted, torch.stack(qs) if qs else None)

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if not self.adaptive or len(tree) == 0:
            return
        if len(acceptance.path) == len(tree):
            self.k = min(self.max_draft, self.k + 1)
        else:
            self.k = max(1, len(acceptance.path) + 1)
