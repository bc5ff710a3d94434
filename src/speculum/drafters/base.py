"""The drafter interface: one small class per drafting method.

A drafter sees the whole token sequence (prompt + generated; its last token is the *root*, the
newest committed token) and proposes a :class:`~speculum.tree.DraftTree` of continuations. After
verification it is told what was accepted so that it can learn (n-gram index, adaptive length,
draft-model cache position).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree
from ..verify import Acceptance


class Drafter(ABC):
    """Base class. Subclasses set ``name`` and implement :meth:`propose`."""

    name: str = "drafter"
    # target hidden-state layers this drafter reads (numbered as in :mod:`speculum.runners.base`);
    # the engine then hands them over through :meth:`see_hidden`
    hidden_layers: tuple[int, ...] = ()
    # whether this drafter reads the target's KV cache (a self-draft); the engine then hands it over
    # through :meth:`see_cache`
    reads_cache: bool = False
    # tokens that end the request (its EOS ids), set by the engine before :meth:`reset`: nothing
    # drafted after one can be committed, so drafters that pay a forward per depth stop there
    end_ids: frozenset[int] = frozenset()
    # how sampled siblings must be drawn (``"iid"`` or ``"without_replacement"``), set by the engine
    # from the verification rule before :meth:`reset` (:mod:`speculum.verify.rules`): a drafter that
    # samples several children of one node draws them so (``verify.rsd.gumbel_top_k`` draws without
    # replacement) and marks its tree ``DraftTree(..., siblings=self.siblings)``
    siblings: str = "iid"
    # the acceptance rule this drafter's method needs in place of the engine's (a Verifier class or
    # factory with its arguments): only BiLD's opt-in lossy rollback; None keeps the exact rule
    verifier_cls = None

    def reset(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        """Start a new request. ``params`` and ``generator`` are the engine's (for sampled drafts)."""
        self.params = params
        self.generator = generator

    @abstractmethod
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        """Draft continuations of ``tokens`` (``tokens[-1]`` is the root) with at most ``budget`` nodes."""

    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        """The target's hidden states ``{layer: [m, D]}`` (the layers of :attr:`hidden_layers`) of the
        ``m`` tokens just cached, in order: the prompt's (all but its last token) after prefill, then
        after each step the root's and the accepted tokens'. Called only for a drafter that asks."""

    def see_batch(self, sequences: int) -> None:
        """How many sequences the coming step's forward serves (1: this one alone), told before each
        :meth:`propose`. A drafter whose drafting runs a forward of its own per sequence holds up the
        whole batch with it, a cost no single sequence's timing shows; ``auto`` drafts with ``mix``
        while it shares a step."""

    def see_cache(self, cache) -> None:
        """The target's KV cache of this request (after :meth:`reset`), for a drafter that
        :attr:`reads_cache`: it may read the committed entries and write into the free slots after
        them, which the next verification forward overwrites."""

    def see_prompt_logits(self, tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor | None) -> None:
        """The outputs ``[e, V]`` of the prompt rows this step's ``tree`` carried
        (:class:`~speculum.tree.PromptRows`, anchors numbered as in ``tree``), or None where the
        runner left them out (batched steps, the reproducible mode, a KV policy). Called before
        :meth:`update`, only for a tree with prompt rows."""

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor) -> None:
        """Called after each step; ``tokens`` already includes the newly committed tokens.

        ``logits`` ``[len(tree) + 1, V]`` are the target's logits for ``[root] + tree.tokens`` (row 0
        predicts the token after the root, row ``i + 1`` the token after node ``i``).
        """

    def fork(self) -> Drafter:
        """A drafter for one more request running at the same time as this one's (a batch): it
        shares what this drafter learns across requests and has its own per-request state.

        Here a shallow copy: right for a drafter whose cross-request state lives in containers made
        in ``__init__`` and changed in place, and whose per-request state is (re)assigned in
        :meth:`reset`. A drafter that holds other drafters, or assigns shared state anew, overrides it.
        """
        return copy.copy(self)

    def finish(self, tokens: list[int]) -> None:
        """Called once when a request ends, with its prompt and output (cross-request drafters learn here)."""
