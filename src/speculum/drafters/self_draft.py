"""The drafting loop every self-drafter shares (``swift``, ``quant_self``, ``kv_draft``): the target's
own decoder, with something taken away (:class:`~speculum.drafting.self_forward.SelfDraft`), drafts
over the target's KV cache.

Each step the root runs first (the committed tokens are already in the target's cache: there is
nothing to catch up on); its logits give the first depth. Then, greedy:

- ``top_k=1``: a chain, stopped early where the drafted token's own probability falls below
  ``exit_confidence`` (SWIFT's confidence-aware drafting; Kangaroo's early exit). With ``lookup``
  (``k > 0``), after each drafted token the chain so far is looked up in the text, prompt lookup
  style (:meth:`~speculum.drafters.ngram.NgramDrafter.continuation`, an n-gram of 2-3 tokens ending
  with the drafted one): where it occurred before, the ``k`` tokens that followed it end the chain
  without further draft forwards. Copied text (a needle's value, a quoted question) then costs
  one draft forward instead of one per token;
- ``top_k>1``: EAGLE-2's dynamic tree (:mod:`speculum.drafting.tree_growth`), all nodes of one depth
  in one forward, growth stopping where a path's probability falls below ``min_path_prob``.

Sampled requests draft a chain, each token drawn from the draft's own distribution q (the request's
temperature / top-k / top-p on the draft logits), q attached for the verifier's ``min(1, p/q)``;
the chain stops where the drawn token's q falls below ``exit_confidence`` (a rule on the draft
alone, so the output distribution stays the target's). The lookup applies as for greedy chains,
each looked-up token proposed with certainty (q a point mass on it: accepted with the target's
probability p of it, as a model-free draft is).

A quantized draft's LM head covers part of the vocabulary where one is known
(:class:`~speculum.drafting.quantized_copy.TrimmedHead`, ``trim``): the frequent tokens of a head shipped
for the target plus each request's prompt tokens.

A subclass sets ``self.model`` (or overrides :meth:`model_for`), its head from :meth:`draft_head`.
"""

from __future__ import annotations

import copy

import torch

from ..drafting.quantized_copy import TrimmedHead, quantized_head
from ..drafting.self_forward import SelfDraft, check_plain_cache
from ..drafting.tree_growth import DynamicTree, sample_chain
from ..errors import SpeculumError
from ..heads import shipped_draft_vocab
from ..runners import runner_for
from ..runners.decoder import NativeDecoder
from ..tree import DraftTree
from .base import Drafter
from .text_lookup import TextLookup


def native_decoder(target: torch.nn.Module, who: str) -> NativeDecoder:
    """The target's native decoder (raises :class:`SpeculumError` where the native runner cannot run it)."""
    try:
        return runner_for(target, "native").decoder
    except SpeculumError as e:
        raise SpeculumError(f"{who} drafts with the target's own layers on the native runner: {e}") from None


class SelfDrafter(TextLookup, Drafter):
    """Chain / tree drafting through a :class:`SelfDraft` over the target's KV cache."""

    reads_cache = True
    model: SelfDraft

    def __init__(self, target: torch.nn.Module, top_k: int = 1, depth: int = 6, max_nodes: int = 24,
                 exit_confidence: float = 0.5, min_path_prob: float = 0.02, draft_head=None, trim: bool = True,
                 trim_vocab: torch.Tensor | None = None, lookup: int = 8):
        # draft_head: the learned drafters' head files, passed to every method that reads the target; unused here
        # trim: a quantized head over ``trim_vocab`` (default: a shipped head's draft vocabulary, where
        # one ships for the target) plus each request's prompt tokens; the whole vocabulary otherwise
        self.trim, self.trim_vocab = trim, trim_vocab
        self.trimmed: TrimmedHead | None = None
        self.decoder = native_decoder(target, self.name)
        self.device = self.decoder.device
        self.top_k, self.depth, self.max_nodes = top_k, depth, max_nodes
        self.exit_confidence, self.min_path_prob = exit_confidence, min_path_prob
        self.target_cache = None
        self.init_lookup(lookup)  # tokens a chain may take from an earlier occurrence of its last 2-3 tokens

    def fork(self) -> SelfDrafter:
        twin = super().fork()
        twin.model = copy.copy(self.model)  # per-step state (the cache it writes into) is per request
        return twin

    def draft_head(self, target: torch.nn.Module, bits: int):
        """The draft's LM head quantized to ``bits``: trimmed where ``trim`` and a vocabulary is
        known for ``target`` (each request then adds its prompt's tokens, :meth:`reset`), else the
        whole head."""
        if self.trim:
            vocab = self.trim_vocab if self.trim_vocab is not None else shipped_draft_vocab(target)
            if vocab is not None:
                vocab = vocab[(vocab >= 0) & (vocab < self.decoder.shape.vocab)]  # another model's: what fits
            if vocab is not None and len(vocab):
                self.trimmed = TrimmedHead(self.decoder, bits, vocab)
                return self.trimmed
        return quantized_head(self.decoder, bits)

    def reset(self, prompt_ids, params, generator) -> None:
        super().reset(prompt_ids, params, generator)
        self.prompt = list(prompt_ids)
        if self.trimmed is not None:
            self.model.head = self.trimmed.with_tokens(self.prompt)

    def see_cache(self, cache) -> None:
        """The request's cache, its prompt prefilled: a selecting view picks its entries now."""
        check_plain_cache(cache, self.decoder, self.name)
        self.target_cache = cache
        self.model.reset()
        prompt = getattr(self, "prompt", None)
        if prompt is not None and cache.length == len(prompt) - 1:
            self.model.prepare(cache, prompt)

    def model_for(self, tokens: list[int]) -> SelfDraft:
        """The draft model of this step (``swift`` searches its layers first)."""
        return self.model

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        cache = self.target_cache
        if budget <= 0 or cache is None or cache.length != len(tokens) - 1:
            return DraftTree()
        model = self.model_for(tokens)
        depth = min(self.depth, budget)
        model.begin(cache, 1 + depth * max(self.top_k, 1), tokens)
        root_pos = len(tokens) - 1
        yes = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        logits = model.run(self._tensor(tokens[-1:]), self._tensor([root_pos]), yes)[0]  # [V]
        if not self.params.greedy:
            return self._sampled_chain(model, logits, root_pos, depth, tokens, min(self.max_nodes, budget))
        return self._tree(model, logits, root_pos, depth, budget, tokens)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """Token ids or positions on the draft's device."""
        return torch.tensor(values, device=self.device)

    def _sampled_chain(self, model: SelfDraft, logits: torch.Tensor, root_pos: int, k: int,
                       tokens: list[int], room: int) -> DraftTree:
        def advance(tok: int, i: int) -> torch.Tensor:
            visible = torch.ones(1, model.used + 1, dtype=torch.bool, device=self.device)
            return model.run(self._tensor([tok]), self._tensor([root_pos + i + 1]), visible)[0]

        return sample_chain(logits, k, self.params, self.generator, advance, self.end_ids,
                            lambda drafted: self.looked_up(tokens, drafted, room), self.exit_confidence)

    def _tree(self, model: SelfDraft, root_logits: torch.Tensor, root_pos: int, depth: int, budget: int,
              tokens: list[int]) -> DraftTree:
        grow = DynamicTree(self.top_k, self.min_path_prob if self.top_k > 1 else 0.0, self.end_ids)
        slot: dict[int, int] = {-1: 0}  # node -> its pending slot (the root's is 0)
        anc: dict[int, list[int]] = {-1: [0]}  # node -> pending slots of its ancestors, the root's included
        room = min(self.max_nodes, budget)
        level = grow.add_children([-1], torch.log_softmax(root_logits[None].float(), -1))

        def expand(frontier: list[int], d: int) -> torch.Tensor:
            visible = grow.expansion_mask(frontier, model.used, slot, anc)
            logits = model.run(self._tensor([grow.tokens[i] for i in frontier]), self._tensor([root_pos + d] * len(frontier)),
                               torch.from_numpy(visible).to(self.device))
            return torch.log_softmax(logits.float(), -1)

        # a chain (top_k 1) looks up continuations and stops where its token's own probability is low
        chain = self.top_k == 1
        grow.grow(level, depth - 1, expand, None,
                  (lambda lv: self.look_up_under(grow, lv, tokens, room)) if chain else None,
                  self.exit_confidence if chain else None)
        return grow.result(room)
