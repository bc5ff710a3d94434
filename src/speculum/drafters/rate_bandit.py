"""A bandit over drafting choices rewarded by measured tokens per second.

An arm's reward is what its steps really bought: the tokens committed by the steps it drafted over
the wall time of those steps (from one ``propose`` to the next, so drafting, verification and
bookkeeping all count). Estimates are discounted sums (``gamma`` per step) so that they follow the
text. Each step picks the arm with the highest upper confidence bound (UCB1 on rates normalised by
the best arm's, ``explore`` weighting the bonus). Used by ``auto`` (which drafter drafts) and by
``lookahead`` (whether its Jacobi window rides along).

The evidence (:class:`ArmRates`) is shared by every fork of a drafter (what pays on this machine
and model does not depend on the request); the step in flight (:class:`StepClock`) is per request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable


class ArmRates:
    """Discounted tokens, seconds and pulls per arm; :meth:`pick` chooses the next step's arm."""

    def __init__(self, arms: Iterable[str], gamma: float = 0.99, explore: float = 0.25):
        self.gamma, self.explore = gamma, explore
        self.tokens = dict.fromkeys(arms, 0.0)  # discounted tokens committed by each arm's steps
        self.seconds = dict.fromkeys(self.tokens, 0.0)  # discounted seconds spent in them
        self.pulls = dict.fromkeys(self.tokens, 0.0)  # discounted number of steps
        self.picks = dict.fromkeys(self.tokens, 0)  # steps, not discounted

    def credit(self, arm: str, tokens: int, seconds: float) -> None:
        """One more step of ``arm``: every arm's evidence decays by ``gamma``, then this one's grows
        (a step of an arm dropped meanwhile is not credited)."""
        if arm not in self.tokens:
            return
        self.picks[arm] += 1
        for a in self.tokens:
            self.tokens[a] *= self.gamma
            self.seconds[a] *= self.gamma
            self.pulls[a] *= self.gamma
        self.tokens[arm] += tokens
        self.seconds[arm] += seconds
        self.pulls[arm] += 1

    def rate(self, arm: str) -> float:
        """Measured tokens per second of ``arm`` (discounted); 0 before its first step."""
        return self.tokens[arm] / self.seconds[arm] if self.seconds[arm] > 0 else 0.0

    def pick(self) -> str:
        """An untried arm first; then the highest UCB of the normalised rate."""
        untried = [a for a in self.tokens if self.pulls[a] < 1e-3]
        if untried:
            return untried[0]
        best = max(self.rate(a) for a in self.tokens) or 1.0
        total = sum(self.pulls.values())
        return max(self.tokens, key=lambda a: self.rate(a) / best
                   + self.explore * math.sqrt(math.log(total + 1) / self.pulls[a]))

    def drop(self, arm: str) -> None:
        """Forget ``arm``: it is not picked again."""
        for table in (self.tokens, self.seconds, self.pulls, self.picks):
            table.pop(arm, None)

    def halve(self) -> None:
        """Halve the evidence (estimates kept, confidence not): a new request may be another kind
        of text, so every arm gets re-tried early."""
        for a in self.tokens:
            self.tokens[a] *= 0.5
            self.seconds[a] *= 0.5
            self.pulls[a] *= 0.5


class StepClock:
    """The step in flight of one request: which arm drafted it, when it began, the length then."""

    def __init__(self, rates: ArmRates, clock: Callable[[], float] = time.perf_counter):
        self.rates, self.clock = rates, clock
        self.pending: tuple[str, float, int] | None = None

    def close(self, length: int) -> None:
        """Credit the step in flight with the tokens committed since it began (``length``: tokens now)."""
        if self.pending is not None:
            arm, start, before = self.pending
            self.pending = None
            self.rates.credit(arm, length - before, self.clock() - start)

    def begin(self, length: int) -> str:
        """Pick this step's arm and start its clock (a step in flight is dropped uncredited: for a
        drafter that closes its steps itself, in ``update``)."""
        arm = self.rates.pick()
        self.pending = (arm, self.clock(), length)
        return arm
