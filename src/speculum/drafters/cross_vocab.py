"""``cross_vocab``: a draft model with another tokenizer drafts for the target, through text.

Papers: Timor, Mamou, Korat, Berchansky, Pereg, Jain, Schwartz, Wasserblat, Harel (2025),
"Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous
Vocabularies", https://arxiv.org/abs/2502.05202 (its string-level exact-match rule, SLEM, which
transformers ships as universal assisted decoding); Ramakrishnan, Mehta, Tandon, Li, Shi, Tahaei,
Ren (2025), "OmniDraft: A Cross-vocabulary, Online Adaptive Drafter for On-device Speculative
Decoding", https://arxiv.org/abs/2507.02659.

The rule (SLEM): the target's committed ids are decoded to text and the text is encoded with the
draft's tokenizer; the draft model drafts a few tokens greedily in its own vocabulary; their text
is encoded with the target's tokenizer and those target ids are verified by the target as any
point-mass draft is (the greedy walk, or keyed sampling for sampled requests): lossless, since
what is committed is decided by the target's logits alone. Only the target ids that stay the same
when the drafted text grows by its last draft token are proposed (a word the draft had not finished
would otherwise be cut into pieces the target does not pick). The text plumbing, and what happens at
the boundary where the last committed target id is part of a word, is
:mod:`~speculum.drafting.vocab_bridge`'s.

Example: target SmolLM2 has committed ``[..., " The", " capital"]``; draft Gemma-3 reads the text
as its own ids and drafts ``" of", " France", " is"``. Its text ``" of France is"`` is encoded with
SmolLM2's tokenizer as ``[" of", " France", " is"]``; without the last draft token the text is
``" of France"``, ``[" of", " France"]``, so ``[" of", " France"]`` is proposed as a chain of two.
If the target's argmax after " capital" is " of" and after " of" is " France", both are accepted
and the target's next argmax is the bonus token.

The draft model keeps its KV cache across steps: each step the context's recent part is encoded
anew (its last ids can change once more text follows them; the older part is translated once,
:class:`~speculum.drafting.vocab_bridge.ContextTranslator`) and the cache is rolled back only to
the first id that changed. The draft length adapts as in transformers' assisted generation (two more after a fully
accepted draft, one fewer otherwise). Not done: OmniDraft's n-gram cache of draft id sequences that
map to target ids, and its online distillation of the draft.

Defaults: ``num_draft=5`` draft tokens to start (transformers starts at 20, a GPU's budget: on a
2-core CPU each draft token is a forward of the whole draft model), at most ``max_draft=10``.
"""

from __future__ import annotations

import copy

import torch

from ..drafting.vocab_bridge import (
    ContextTranslator,
    appended_text,
    continuation_ids,
    special_ids,
    special_map,
    stable_prefix,
)
from ..errors import SpeculumError
from ..sampling import SamplingParams
from ..tree import DraftTree
from ..verify import Acceptance
from .base import Drafter
from .draft_model import DraftModelDrafter


class CrossVocabDrafter(Drafter):
    """Draft with ``draft_model`` (whose tokenizer is ``draft_tokenizer``) for a target whose
    tokenizer is ``target_tokenizer``: chains of target ids, point masses."""

    name = "cross_vocab"

    def __init__(self, draft_model: torch.nn.Module, target_tokenizer=None, draft_tokenizer=None,
                 num_draft: int = 5, max_draft: int = 10, adaptive: bool = True):
        if target_tokenizer is None or draft_tokenizer is None:
            raise SpeculumError("cross_vocab needs the target's and the draft model's tokenizers")
        if not 2 <= num_draft <= max_draft:
            raise SpeculumError(f"cross_vocab needs 2 <= num_draft <= max_draft; got {num_draft}, {max_draft}")
        self.target_tok, self.draft_tok = target_tokenizer, draft_tokenizer
        self.drafter = DraftModelDrafter(draft_model, num_draft=max_draft, adaptive=False)
        self.drafter.end_ids = frozenset(int(i) for i in _eos_ids(draft_tokenizer, draft_model))
        specials = special_map(target_tokenizer, draft_tokenizer)  # target special id -> draft's or None
        self.translate = ContextTranslator(target_tokenizer, draft_tokenizer, specials)  # target ids -> draft ids
        self.target_specials = special_ids(target_tokenizer)
        self.start_k, self.max_draft, self.adaptive = num_draft, max_draft, adaptive

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        self.drafter.reset(self._draft_context(prompt_ids), SamplingParams(), None)  # drafts are argmax chains
        self.k = self.start_k

    def fork(self) -> CrossVocabDrafter:
        twin = super().fork()
        twin.drafter = self.drafter.fork()
        twin.translate = copy.copy(self.translate)
        twin.translate.reset()
        return twin

    def _draft_context(self, tokens: list[int]) -> list[int]:
        """The committed target ids ``[n]`` as the draft tokenizer's ids."""
        return self.translate(tokens)

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        if budget <= 0:
            return DraftTree()
        context = self._draft_context(tokens)
        if not context:
            return DraftTree()
        drafted = self.drafter.propose(context, self.k).tokens  # draft ids
        return DraftTree.chain(self.target_ids(tokens, context, drafted)[:budget])

    def target_ids(self, tokens: list[int], context: list[int], drafted: list[int]) -> list[int]:
        """The target ids of the drafted text that a longer draft would not change."""
        if not drafted:
            return []
        ended = drafted[-1] in self.drafter.end_ids
        if ended:
            drafted = drafted[:-1]
        text = appended_text(self.draft_tok, context, drafted)
        ids = continuation_ids(self.target_tok, tokens, text, self.target_specials)
        if ended:
            return ids
        shorter = appended_text(self.draft_tok, context, drafted[:-1])
        return stable_prefix(ids, continuation_ids(self.target_tok, tokens, shorter, self.target_specials))

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        if not self.adaptive:
            return
        if len(tree) == len(acceptance.path):  # all accepted, or no stable id drafted: draft further
            self.k = min(self.max_draft, self.k + 2)
        else:
            self.k = max(2, self.k - 1)  # the stable prefix of one draft token's text is always empty


def _eos_ids(tokenizer, model) -> list[int]:
    """The draft's end-of-sequence ids: its tokenizer's and its generation config's."""
    ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    return sorted(ids)
