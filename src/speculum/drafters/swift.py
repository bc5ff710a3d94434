"""``swift``: the target with some of its layers skipped drafts for itself, the skipped set found on
the fly (SWIFT, Xia et al. 2025, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration"). No training, no extra weights.

The draft runs the kept layers over the target's own KV cache (:mod:`speculum.drafting.self_forward`);
a skipped layer passes its input through. Drafting is :class:`~speculum.drafters.self_draft.SelfDrafter`'s:
a chain stopped where the drafted token's probability falls below ``exit_confidence`` (SWIFT's
confidence-aware drafting), or a dynamic tree with ``top_k > 1``.

**Layer-set search** (SWIFT's context-based optimisation). At the first step with at least
``min_context`` committed tokens, the last ``search_rows`` of them are run teacher-forced through
the full model and through candidate skipped models (each reading the target's cache before them,
its own entries within them), and a candidate's *match rate* is how often its argmax equals the
full model's. A candidate with match rate ``a`` and cost ``c`` (its share of the weights a step
reads) is worth the best expected speed over chain lengths ``g``:
``(1 - a^(g+1)) / (1 - a) / (g c + 1)`` (tokens per step over the draft-and-verify time, in
target-step units). The search tries random sets at several skip ratios (first and last layers
always kept), then mutates the best (one skipped layer swapped for a kept one), within
``search_trials`` candidates. The best set is kept for every later request of this drafter (and its
forks). ``skip`` gives a set and skips the search.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..drafting.layer_cost import best_depth, kept_share
from ..drafting.self_forward import SelfDraft
from ..errors import SpeculumError
from .self_draft import SelfDrafter

SKIP_RATIOS = (0.2, 0.3, 0.4, 0.5)


class SwiftDrafter(SelfDrafter):
    name = "swift"

    def __init__(self, target: torch.nn.Module, skip: Sequence[int] | None = None, search_rows: int = 48,
                 search_trials: int = 48, min_context: int = 16, seed: int = 0, depth: int = 6, **options):
        super().__init__(target, depth=depth, **options)
        n = self.decoder.shape.layers
        if skip is not None and any(not 0 <= i < n for i in skip):
            raise SpeculumError(f"swift skips layers among 0..{n - 1}; got {sorted(skip)}")
        self.search_rows, self.search_trials, self.min_context = search_rows, search_trials, min_context
        self.seed = seed
        self.found: dict = {}  # shared with forks: "skip" -> the chosen set, "match", "cost", "worth"
        if skip is not None:
            self.found["skip"] = sorted(set(skip))
        self.model = self._model(self.found.get("skip", []))

    def _kept(self, skip: Sequence[int]) -> list[int]:
        return [i for i in range(self.decoder.shape.layers) if i not in set(skip)]

    def _model(self, skip: Sequence[int]) -> SelfDraft:
        return SelfDraft(self.decoder, layers=self._kept(skip))

    def model_for(self, tokens: list[int]) -> SelfDraft:
        if "skip" not in self.found:
            if self.target_cache.length < self.min_context:
                return self.model  # too little context to judge a set: the full model drafts meanwhile
            self._search(tokens)
        if self.model.layers != self._kept(self.found["skip"]):
            self.model = self._model(self.found["skip"])
        return self.model

    def cost(self, skip: Sequence[int]) -> float:
        """A skipped model's step cost as a share of the full model's: the weights it reads."""
        return kept_share(self.decoder, self.decoder.shape.layers - len(skip))

    def worth(self, match: float, cost: float) -> float:
        """The best expected speed over chain lengths, in units of plain decoding's (module docstring)."""
        return best_depth(match, cost, range(1, self.depth + 1))[1]

    @torch.inference_mode()
    def _argmax(self, skip: Sequence[int], ids: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        """The greedy tokens of the model skipping ``skip`` at rows ``ids``, teacher-forced after the
        first ``start`` committed entries."""
        model = self._model(skip)
        model.begin(self.target_cache, ids.shape[0])
        causal = torch.ones(ids.shape[0], ids.shape[0], dtype=torch.bool, device=self.device).tril()
        return model.run(ids, positions, causal, committed=start).argmax(-1)

    def _search(self, tokens: list[int]) -> None:
        n_layers = self.decoder.shape.layers
        length = self.target_cache.length
        rows = min(self.search_rows, length)
        start = length - rows
        ids, positions = self._tensor(tokens[start:length]), self._tensor(list(range(start, length)))
        want = self._argmax([], ids, positions, start)
        rng = random.Random(self.seed)
        middle = list(range(1, n_layers - 1))
        if not middle:
            self.found.update(skip=[], worth=1.0, cost=1.0, match=1.0)
            return
        tried: dict[tuple[int, ...], float] = {}  # skipped set -> its worth
        matches: dict[tuple[int, ...], float] = {}

        def score(skip: list[int]) -> None:
            key = tuple(sorted(skip))
            if key not in tried:
                matches[key] = float((self._argmax(key, ids, positions, start) == want).float().mean())
                tried[key] = self.worth(matches[key], self.cost(key))

        explore = self.search_trials // 2
        for t in range(self.search_trials):
            if t < explore or not tried:  # random sets at each skip ratio in turn
                ratio = SKIP_RATIOS[t % len(SKIP_RATIOS)]
                score(rng.sample(middle, max(1, min(len(middle), round(ratio * n_layers)))))
                continue
            best = list(max(tried, key=tried.get))  # then mutations of the best: one skipped layer swapped
            kept = [i for i in middle if i not in best]
            if not kept:
                break
            best[rng.randrange(len(best))] = rng.choice(kept)
            score(best)
        best = max(tried, key=tried.get)
        self.found.update(skip=list(best), worth=tried[best], cost=self.cost(best), match=matches[best])
