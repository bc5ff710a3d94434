"""``specdecpp``: SpecDec++'s adaptive draft length with a trained acceptance head (Huang, Guo,
Wang 2024, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths",
https://arxiv.org/abs/2405.19715).

A draft model with the target's tokenizer drafts a chain, as ``draft_model`` does. After each
drafted token ``y_i`` the acceptance head (:mod:`speculum.heads.acceptance`) reads the draft's last
hidden state that ``y_i`` was drafted from and predicts ``a_i = P(y_i accepted | y_1..y_{i-1}
accepted)``. Drafting stops once the predicted probability that at least one drafted token is
rejected exceeds the threshold ``h``:

    1 - prod_{j <= i} a_j > h   ->   stop after y_i

(or at ``max_draft`` tokens). The rule only decides how long the chain is, before the target sees
it, so verification stays exact: the output is the target's.

Example (``h=0.5``): predicted a = .9, .8, .7 -> P(a rejection) = .1, .28, .496: draft a fourth
token; if its a = .9 -> .55 > .5: stop with four tokens.

Defaults: ``stop=0.7`` (the paper sweeps h over (0, 1); the best value depends on the models and
the cost of a target step against a draft step, so it is an option); ``max_draft=8``.

The head: ``head=PATH`` (or ``--draft-head PATH``), trained by ``python -m speculum.train.acceptance``
for one (target, draft) pair. Without one, the head shipped for the pair, if any
(:func:`~speculum.heads.acceptance.shipped_acceptance_head`: for the packaged SmolLM2, its first 24
layers as the draft, ``benchmarks/truncated_copy.py --layers 24``); a head shipped for another draft
is never used. Where there is none, the draft's own probability, calibrated online, stands in for
the head's prediction (``draft_model``'s ``stop_risk``), with a warning; ``head="calibrated"``
asks for that stand-in without the warning. A given head whose file records another draft warns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import SpeculumError
from ..heads.acceptance import (
    AcceptanceHead,
    load_acceptance_head,
    read_acceptance_meta,
    same_draft,
    shipped_acceptance_head,
)
from ..tree import DraftTree
from .draft_model import DraftModelDrafter


def rejection_risk(accept_probs: Sequence[float]) -> float:
    """``1 - prod(accept_probs)``: the predicted probability that at least one token is rejected."""
    return 1.0 - math.prod(accept_probs)


def stop_after(accept_probs: Sequence[float], threshold: float) -> int:
    """How many tokens SpecDec++'s rule drafts given each token's predicted acceptance
    probability ``accept_probs`` (at most their number): the first ``i`` whose
    :func:`rejection_risk` of ``accept_probs[:i]`` exceeds ``threshold``."""
    for i in range(1, len(accept_probs) + 1):
        if rejection_risk(accept_probs[:i]) > threshold:
            return i
    return len(accept_probs)


class SpecDecPPDrafter(DraftModelDrafter):
    """Chains from a draft model, stopped by a trained acceptance head (see the module docstring)."""

    name = "specdecpp"

    def __init__(self, draft_model: torch.nn.Module, head: AcceptanceHead | str | Path | None = None,
                 draft_head: Sequence[str | Path] | str | Path | None = None, stop: float = 0.7,
                 max_draft: int = 8, target: torch.nn.Module | None = None):
        stop = float(stop)
        if not 0.0 < stop < 1.0:
            raise SpeculumError(f"specdecpp's stop threshold h is a probability in (0, 1); got {stop}")
        given = head if head is not None else _first(draft_head)
        calibrated = isinstance(given, str) and given == "calibrated"
        # read before the draft's runner is built (it may release the draft's layer weights)
        if given is None and target is not None:
            given = shipped_acceptance_head(target, draft_model)
        elif isinstance(given, str | Path) and not calibrated:
            _warn_if_other_draft(Path(given).expanduser(), draft_model)
        super().__init__(draft_model, num_draft=int(max_draft), adaptive=False)
        self.stop = stop
        self.head_file = Path(given) if isinstance(given, str | Path) and not calibrated else None
        self.head = None if calibrated else self._load(given)
        if self.head is None:  # the head-free stand-in: draft_model's calibrated probability, same rule
            if not calibrated:
                warnings.warn("specdecpp without an acceptance head for this draft (none given with head=PATH or "
                              "--draft-head, none shipped for this target and draft): the draft's calibrated "
                              "probability stands in for it (train one: python -m speculum.train.acceptance)",
                              stacklevel=2)
            self.stop_risk = stop
        self.layer = self.runner.num_layers  # the final norm's output
        self.predicted: list[float] = []  # this step's a_i, for inspection

    def _load(self, head) -> AcceptanceHead | None:
        if head is None or isinstance(head, AcceptanceHead):
            return None if head is None else head.eval().requires_grad_(False)
        hidden = self.model.config.get_text_config().hidden_size
        return load_acceptance_head(head, hidden)[0]

    def _next_logits(self, last: int) -> torch.Tensor:
        if self.head is None:
            return super()._next_logits(last)
        out = self.runner.forward(self.cache, last, DraftTree(), (self.layer,))
        self.cache.commit()
        self.seen.append(last)
        self.hidden = out.hidden[self.layer][-1]  # [D]
        return out.logits[-1]

    def _chain(self, last: int, k: int) -> DraftTree:
        self.predicted = []
        return super()._chain(last, k)

    def _stops_after(self, probs: torch.Tensor, token: int) -> bool:
        if self.head is None:
            return super()._stops_after(probs, token)
        self.predicted.append(float(self.head.accept_prob(self.hidden, probs[token])))
        return rejection_risk(self.predicted) > self.stop


def _warn_if_other_draft(path: Path, draft_model: torch.nn.Module) -> None:
    """Warn when the head file at ``path`` records a draft other than ``draft_model``."""
    recorded = read_acceptance_meta(path).get("draft_fingerprint") if path.is_file() else None
    if recorded and not same_draft(recorded, draft_model):
        warnings.warn(f"acceptance head {path.name} was trained for another draft model "
                      f"({recorded.get('layers')} layers, hidden size {recorded.get('hidden')}): its predictions "
                      "may not fit this one", stacklevel=3)


def _first(files: Sequence[str | Path] | str | Path | None) -> str | Path | None:
    """The first of ``--draft-head``'s files (specdecpp reads one acceptance head)."""
    if files is None or isinstance(files, (str, Path)):
        return files
    return files[0] if files else None
