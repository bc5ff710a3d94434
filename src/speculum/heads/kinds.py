"""The learned drafting methods, one record each: what a learned drafter is to speculum.

A :class:`LearnedKind` names the head's config and module (how a head file loads), the drafter that
drafts with it, the trainer that trains it and the training defaults where they depart from
``train-draft``'s, and whether ``auto`` adds it as an arm. Loading (:func:`~speculum.heads.load_head`),
the method registry (:data:`~speculum.drafters.DRAFTERS`), ``auto``'s arms and ``train-draft`` all
read :data:`LEARNED`, so a new learned drafter is its file(s) plus one entry here (or one
:func:`speculum.drafters.register_learned` call).

The drafter and trainer are given as ``"module:Class"`` strings (imported when first used: the
drafters and trainers live in layers above this one) or as the classes themselves.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from .clover import CloverConfig, CloverHeads
from .eagle import EagleConfig, EagleHead
from .hydra import HydraConfig, HydraHeads
from .kangaroo import KangarooAdapter, KangarooConfig
from .medusa import MedusaConfig, MedusaHeads
from .ppd import PPDConfig, PPDPrompts


@dataclass(frozen=True)
class LearnedKind:
    """One learned drafting method (see the module docstring)."""

    config: type  # the head's config dataclass
    # its torch module: ``module(config)``, with ``freeze()`` for drafting (``freeze(quantized=True)``
    # where it takes that and the target's weights are quantized: its products on Q8_0 copies)
    module: type
    drafter: str | type  # its Drafter class, or "module:Class"
    summary: str  # one line for ``--help`` and the method table
    trainer: str | type | None = None  # its trainer (a HeadTrainer), or None where it cannot be trained yet
    train_defaults: dict = field(default_factory=dict)  # train-draft options that differ for this kind
    auto: bool = True  # ``auto`` adds it as an arm where a head for the target exists

    def drafter_class(self) -> type:
        return resolve(self.drafter)

    def trainer_class(self) -> type:
        return resolve(self.trainer)


def resolve(ref: str | type) -> type:
    """``"package.module:Class"`` -> the class (a class is returned as it is)."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


LEARNED: dict[str, LearnedKind] = {
    "eagle": LearnedKind(EagleConfig, EagleHead, "speculum.drafters.eagle:EagleDrafter",
                         "a trained EAGLE feature head drafting EAGLE-2's dynamic tree",
                         "speculum.train.eagle:EagleTrainer"),
    "medusa": LearnedKind(MedusaConfig, MedusaHeads, "speculum.drafters.medusa:MedusaDrafter",
                          "trained Medusa-1 heads on the target's last feature, best-first tree",
                          # one LM-head product per head and position: the CPU's budget
                          "speculum.train.medusa:MedusaTrainer", {"epochs": 4}),
    "hydra": LearnedKind(HydraConfig, HydraHeads, "speculum.drafters.hydra:HydraDrafter",
                         "trained Hydra heads (Medusa heads reading the drafted tokens), dynamic tree",
                         "speculum.train.medusa:HydraTrainer", {"epochs": 4}),
    "clover": LearnedKind(CloverConfig, CloverHeads, "speculum.drafters.clover:CloverDrafter",
                          "trained Clover heads (a regressive attention decoder over the context), dynamic tree",
                          # not an auto arm: the shipped head is undertrained (docs/heads.md)
                          "speculum.train.clover:CloverTrainer", {"epochs": 4}, auto=False),
    "kangaroo": LearnedKind(KangarooConfig, KangarooAdapter, "speculum.drafters.kangaroo:KangarooDrafter",
                            "the target's first layers and a trained adapter draft chains with early exit "
                            "(Kangaroo)", "speculum.train.kangaroo:KangarooTrainer", {"epochs": 5}),
    # PPD's N = 3 prompt tokens and learning rate; it trains N * D numbers, each step through the whole
    # target: 600 samples suffice
    "ppd": LearnedKind(PPDConfig, PPDPrompts, "speculum.drafters.ppd:PPDDrafter",
                       "trained prompt tokens in the verification forward predict the next step's tree (PPD)",
                       "speculum.train.ppd:PPDTrainer",
                       {"epochs": 1, "heads": 3, "vocab": 0, "lr": 1e-2, "max_samples": 600}),
}
