"""``auto``: a bandit that picks, step by step, the drafter that yields the most tokens per second.

Arms: ``mix`` (trees from speculum's variants of suffix decoding and Token Recycling,
``suffix_merged`` and ``recycling_scored``), ``ngram`` (prompt-lookup chains, which reach further
on long verbatim copies; scored by learnt hit rates, so that the tree sizer cuts them to what pays on
this hardware, as it cuts ``mix``'s trees) and ``none`` (plain decoding). Standalone ``suffix`` and ``recycling``
arms were dropped after measuring: ``mix`` contains both, and every extra arm costs
exploration steps. The reward of an arm is measured, not predicted (:mod:`~speculum.drafters.rate_bandit`):
the tokens committed by the steps it drafted over the wall time of those steps. Estimates are
discounted sums (``gamma`` per step) so they follow the text; they persist across requests, with
the evidence halved at each new request so that every arm is re-tried early (without that, a poor
first step could lock the bandit onto plain decoding for whole requests). Each step picks the arm
with the highest upper confidence bound, so an arm that stops paying (nothing matches, drafts get
rejected) loses to ``none`` (BENCHMARKS.md, "Where nothing matches"). The tree sizer already shrinks hopeless trees to
nothing; the bandit also catches costs the sizer does not model.

**Arms that do not pay are retired.** A learned or self-drafting arm whose measured rate stays below
:data:`KEEP_RATIO` times the best model-free arm's (``mix``, ``ngram``, ``none``), after
:data:`TRIAL_STEPS` steps of its own or :data:`PATIENCE_STEPS` steps of the bandit, is dropped: it
is no longer explored and no longer reads the target's hidden states at every step. Where ``auto``
was given an :class:`~speculum.drafters.arm_memory.ArmMemory` (the methods built by
:func:`speculum.methods.build_method` are), the retirement is remembered per model and machine, so
later runs do not build that arm at all.

The arms share their state (one suffix trie, one recycling matrix), so every arm keeps learning
from every step whichever arm drafted it.

Learned drafters (``eagle`` and the others, where a head for the target is shipped or given) are
more arms. They read the target's hidden states and prompt-row outputs of every step, whichever
arm drafted it, so their own state stays in step (a ``ppd`` arm drafts from the prompt rows that
the tree of the step before carried: whatever arm drafts, auto hangs ``ppd``'s rows onto its tree
only when ``ppd`` drafted that step, so ``ppd`` drafts only on consecutive picks). A learned arm's
``update`` runs after the steps it drafted.

``auto_self`` adds self-drafters the same way (``lookahead``, ``quant_self``): auto hands them the
request's KV cache; ``lookahead``'s window rides only on the steps it drafts, and its pool reads the
whole text (prompt and output) whichever arm drafted.

**In a batch** (a step whose forward serves several sequences, :meth:`Drafter.see_batch`) auto drafts
with ``mix`` and leaves the bandit out. Every sequence's timing there is the batch's step, the
same whatever arm it drafted with, so the bandit cannot tell its arms apart: a learned or
self-drafting arm runs forwards of its own for its one sequence while the whole batch waits,
and no sequence's timing shows it. ``mix``'s trees carry acceptance scores, and the tree sizer
already cuts every sequence's tree for the batch's throughput, down to nothing where drafting no
longer pays (:meth:`~speculum.tree_sizing.TreeSizer.select_batch`), which is what the ``none`` arm
is for alone. Measured on one serve-like engine (BENCHMARKS.md, "``auto`` in a batch"), this made
``auto`` as fast as ``mix`` in batches of 4. The learned arms still read every step's hidden
states, and the bandit picks again once the sequence steps alone. (The server's ``auto`` has no
learned arms at all: see :meth:`~speculum.server.app.ServerState.get_method`.)
"""

from __future__ import annotations

import time

from ..tree import DraftTree
from ..verify import Acceptance
from .ar import AutoregressiveDrafter
from .arm_memory import ArmMemory
from .base import Drafter
from .mix import MixDrafter
from .ngram import NgramDrafter
from .rate_bandit import ArmRates, StepClock
from .recycling import RecyclingDrafter
from .suffix_merged import SuffixMergedDrafter

BATCH_ARM = "mix"  # what auto drafts with in a batch
MODEL_FREE = ("mix", "ngram", "none")  # the arms a learned arm must beat to stay
TRIAL_STEPS = 16  # steps of its own after which a learned arm that does not pay is retired
PATIENCE_STEPS = 64  # steps of the bandit after which it is retired however few it drafted
KEEP_RATIO = 0.9  # a learned arm stays while its rate is at least this share of the best model-free arm's


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(self, gamma: float = 0.99, explore: float = 0.25, clock=time.perf_counter,
                 learned: dict[str, Drafter] | None = None, memory: ArmMemory | None = None,
                 arm_names: dict[str, str] | None = None):
        # learned: more arms by name, the learned drafters' and the self-drafters' (``auto_self``);
        # memory: where retired arms are recorded, under arm_names[name] (default: the name)
        self.suffix, self.recycling = SuffixMergedDrafter(), RecyclingDrafter(tree="scored", pair_context=True)
        self.ngram = NgramDrafter(scored=True)  # its chains sized to the hardware like mix's trees
        self.learned = dict(learned or {})
        self.arms: dict[str, Drafter] = {
            "mix": MixDrafter([self.suffix, self.recycling]),
            "ngram": self.ngram,
            "none": AutoregressiveDrafter(),
            **self.learned,
        }
        self.memory, self.arm_names = memory, dict(arm_names or {})
        self._sync_learned()
        self.rates = ArmRates(self.arms, gamma, explore)  # shared with forks
        self.clock = clock
        self.steps = StepClock(self.rates, clock)
        self.batched = False  # whether the coming step is shared with other sequences (see_batch)
        self.chosen: list[str] = []  # arm of every step of the current request (for reports)

    def fork(self) -> AutoDrafter:
        """Forked arms; the bandit's evidence (:class:`ArmRates`) stays shared."""
        twin = super().fork()
        twin.suffix, twin.recycling, twin.ngram = self.suffix.fork(), self.recycling.fork(), self.ngram.fork()
        twin.arms = {"mix": MixDrafter([twin.suffix, twin.recycling]), "ngram": twin.ngram,
                     "none": self.arms["none"].fork()}
        twin.learned = {name: d.fork() for name, d in self.learned.items()}
        twin.arms.update(twin.learned)
        twin.chosen, twin.batched, twin.steps = [], False, StepClock(self.rates, self.clock)
        return twin

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        for d in (self.suffix, self.recycling, self.ngram, *self.learned.values()):
            d.end_ids = self.end_ids
            d.reset(prompt_ids, params, generator)
        self.rates.halve()
        self.chosen = []
        self.steps.pending = None

    def see_batch(self, sequences: int) -> None:
        self.batched = sequences > 1

    def start_step(self, length: int) -> str:
        """Credit the previous step (a solo one), pick this step's arm (:data:`BATCH_ARM` in a
        batch, unclocked) and start its clock; ``length``: tokens so far."""
        self.steps.close(length)
        if self.learned:
            self._retire_losers()
        arm = BATCH_ARM if self.batched else self.steps.begin(length)
        self.chosen.append(arm)
        return arm

    def _sync_learned(self) -> None:
        """What the engine hands the arms: hidden layers and the cache, for the learned arms kept."""
        self.hidden_layers = tuple(sorted({i for d in self.learned.values() for i in d.hidden_layers}))
        self.reads_cache = any(d.reads_cache for d in self.learned.values())  # a self-drafting arm

    def _retire_losers(self) -> None:
        """Drop the learned arms that do not pay (module docstring), and those a fork dropped."""
        rates = self.rates
        free = max(rates.rate(a) for a in MODEL_FREE)
        total = sum(rates.picks.values())
        for name in list(self.learned):
            if name in rates.tokens:
                picks = rates.picks[name]
                if not (picks >= 1 and (picks >= TRIAL_STEPS or total >= PATIENCE_STEPS)
                        and rates.rate(name) < KEEP_RATIO * free):
                    continue
                rates.drop(name)
                if self.memory is not None:
                    self.memory.retire(self.arm_names.get(name, name))
            del self.learned[name], self.arms[name]
            self._sync_learned()

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        return self.arms[self.start_step(len(tokens))].propose(tokens, budget)

    def see_hidden(self, hidden) -> None:
        for d in self.learned.values():
            if d.hidden_layers:
                d.see_hidden({i: hidden[i] for i in d.hidden_layers})

    def see_cache(self, cache) -> None:
        for d in self.learned.values():
            if d.reads_cache:
                d.see_cache(cache)

    def see_prompt_logits(self, tree, acceptance, logits) -> None:
        if self.chosen and self.chosen[-1] in self.learned:
            self.learned[self.chosen[-1]].see_prompt_logits(tree, acceptance, logits)

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits=None) -> None:
        self.arms["mix"].update(tokens, tree, acceptance, logits)  # the suffix trie and recycling table
        if self.chosen and self.chosen[-1] == "ngram":
            self.ngram.update(tokens, tree, acceptance, logits)
        elif self.chosen and self.chosen[-1] in self.learned:
            self.learned[self.chosen[-1]].update(tokens, tree, acceptance, logits)

    def finish(self, tokens: list[int]) -> None:
        self.steps.close(len(tokens))
        self.suffix.finish(tokens)
