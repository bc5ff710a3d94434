"""Drafters: one file per drafting method, and the registry that names them.

A drafter proposes a :class:`~speculum.tree.DraftTree` below the root each step and learns from what
the target accepted (:class:`~speculum.drafters.base.Drafter`). Adding one is one file and one line
in :data:`DRAFTERS`; every engine method (:mod:`speculum.methods`) is a registry entry. A learned
drafter (a head file, a trainer) is one entry of :data:`~speculum.heads.kinds.LEARNED` instead,
from which its line here is made (:func:`register_learned` adds one at run time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..heads import LEARNED, LearnedKind, find_head, pick_head
from .aded import AdedDrafter
from .ar import AutoregressiveDrafter
from .arm_memory import ArmMemory, arm_name
from .auto import AutoDrafter
from .base import Drafter
from .bild import BiLDDrafter
from .cross_vocab import CrossVocabDrafter
from .del_exit import DelDrafter
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .hydra import HydraDrafter
from .kangaroo import KangarooDrafter
from .kv_draft import KVDraftDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .mix import MixDrafter
from .ngram import NgramDrafter
from .online_adapt import OnlineAdaptDrafter
from .pearl import PearlDrafter
from .ppd import PPDDrafter
from .quant_self import QuantSelfDrafter
from .recycling import RecyclingDrafter
from .specdecpp import SpecDecPPDrafter
from .stand import StandDrafter
from .suffix import SuffixDrafter
from .suffix_merged import SuffixMergedDrafter
from .swift import SwiftDrafter


@dataclass(frozen=True)
class DrafterEntry:
    """How to build one named drafter.

    ``factory(**options)`` makes it (``draft_model=`` is passed when ``needs_draft_model``,
    ``target=`` the target transformers model and ``draft_head=`` a head file when ``needs_target``:
    learned heads read the target's embedding and LM head; ``target_tokenizer=`` and ``draft_tokenizer=``
    when ``takes_tokenizers``: its draft model may have any tokenizer);
    ``scored``: its trees carry acceptance scores, so the engine sizes them to the hardware's cost
    curve (:class:`~speculum.tree_sizing.TreeSizer`); ``max_tree``: the engine's budget of drafted
    nodes per step; ``remembers_arms``: it takes ``memory_key=``, the runner's calibration key, under
    which it remembers the arms that did not pay (:mod:`~speculum.drafters.arm_memory`).
    """

    factory: Callable[..., Drafter]
    summary: str
    scored: bool = False
    needs_draft_model: bool = False
    needs_target: bool = False
    takes_tokenizers: bool = False
    max_tree: int = 64
    remembers_arms: bool = False


# the self-drafters ``auto_self`` adds as arms (swift is left out: its layer search costs steps and
# it runs below ar on the packaged models, BENCHMARKS.md "Self-speculation")
AUTO_SELF = ("lookahead", "quant_self")


def _auto(target=None, draft_head=None, learned: bool | tuple[str, ...] = True, self_drafts: tuple[str, ...] = (),
          memory_key: str | None = None, **options) -> AutoDrafter:
    """``auto``, with an arm for every learned drafter of ``learned`` (True: those of
    :data:`~speculum.heads.kinds.LEARNED` marked ``auto``)
    whose head for the target is given or shipped, and one for each self-drafter of ``self_drafts``;
    ``memory_key``: the calibration key under which retired arms are remembered
    (:mod:`~speculum.drafters.arm_memory`: those are not built)."""
    kinds = tuple(k for k, spec in LEARNED.items() if spec.auto) if learned is True else tuple(learned or ())
    memory = ArmMemory.for_key(memory_key) if memory_key else None
    arms, names = {}, {}
    for kind in kinds if target is not None else ():
        path = pick_head(draft_head, kind) or find_head(target, kind)
        if path is not None:
            names[kind] = arm_name(kind, path)
            if memory is None or names[kind] not in memory.names:
                arms[kind] = DRAFTERS[kind].factory(target=target, draft_head=path)
    for kind in self_drafts if target is not None else ():
        names[kind] = arm_name(kind, None)
        if memory is None or names[kind] not in memory.names:
            arms[kind] = DRAFTERS[kind].factory(target=target)
    return AutoDrafter(learned=arms, memory=memory, arm_names=names, **options)


def _mix(**options) -> MixDrafter:
    return MixDrafter([SuffixMergedDrafter(), RecyclingDrafter(tree="scored", pair_context=True)], **options)


def learned_entry(kind: LearnedKind) -> DrafterEntry:
    """The registry line of a learned drafting method (its drafter imported when first built)."""
    return DrafterEntry(lambda **options: kind.drafter_class()(**options), kind.summary, scored=True, needs_target=True)


# the registry: a drafter is one file and one line here
DRAFTERS: dict[str, DrafterEntry] = {
    "ar": DrafterEntry(AutoregressiveDrafter, "plain decoding through speculum's engine (the baseline of speedup_vs_ar)"),
    "ngram": DrafterEntry(NgramDrafter, "prompt lookup with an incremental index and adaptive draft length"),
    "ngram_tree": DrafterEntry(partial(NgramDrafter, branches=4), "prompt lookup drafting a tree from several matches"),
    "suffix": DrafterEntry(SuffixDrafter, "SuffixDecoding (the paper's rule): per match length, best tree", scored=True),
    "suffix_merged": DrafterEntry(SuffixMergedDrafter, "speculum's suffix decoding: longest matches merged, "
                                  "calibrated scores", scored=True),
    "recycling": DrafterEntry(RecyclingDrafter, "Token Recycling (the paper's rule): static 80-node tree",
                              max_tree=80),
    "recycling_scored": DrafterEntry(partial(RecyclingDrafter, tree="scored", pair_context=True),
                                     "speculum's Token Recycling: best-first tree, token-pair table", scored=True),
    "aded": DrafterEntry(AdedDrafter, "ADED: an adaptive tri-gram matrix of the text drafted by Monte-Carlo tree "
                         "search (model-free), calibrated scores", scored=True, max_tree=32),
    "stand": DrafterEntry(StandDrafter, "STAND: n-grams that keep the target's distributions; sampled drafts "
                          "carry q, siblings by Gumbel-top-k (model-free); greedy trees sized by calibrated scores",
                          scored=True, max_tree=24),
    "mix": DrafterEntry(_mix, "suffix_merged and recycling_scored candidates in one tree", scored=True),
    "auto": DrafterEntry(_auto, "a bandit over mix / ngram / the learned drafters / none by measured tokens per second",
                         scored=True, needs_target=True, remembers_arms=True),
    "auto_self": DrafterEntry(partial(_auto, self_drafts=AUTO_SELF), "auto with the self-drafters lookahead and "
                              "quant_self as more arms", scored=True, needs_target=True, remembers_arms=True),
    "draft_model": DrafterEntry(DraftModelDrafter, "a smaller model with the same tokenizer drafts chains",
                                needs_draft_model=True),
    "draft_model_tree": DrafterEntry(partial(DraftModelDrafter, top_k=4), "a smaller model with the same tokenizer "
                                     "drafts EAGLE-2's dynamic tree (top 4 per node), sized; sampled requests: a tree "
                                     "sampled from it", scored=True,
                                     needs_draft_model=True),
    "bild": DrafterEntry(BiLDDrafter, "Big Little Decoder: a smaller same-tokenizer model drafts until its top "
                         "probability falls below a fallback threshold; exact verification (rollback=0)",
                         needs_draft_model=True),
    "specdecpp": DrafterEntry(SpecDecPPDrafter, "SpecDec++: a draft model's chain stopped by a trained acceptance "
                              "head (head=PATH, --draft-head or the one shipped for the target and draft) once "
                              "P(a rejection) > h", needs_draft_model=True, needs_target=True),
    "cross_vocab": DrafterEntry(CrossVocabDrafter, "a smaller model with another tokenizer drafts chains through "
                                "text, re-tokenized both ways (SLEM, OmniDraft)", needs_draft_model=True,
                                takes_tokenizers=True),
    "pearl": DrafterEntry(PearlDrafter, "PEARL: a smaller model with the same tokenizer drafts the next chunk in a "
                          "thread while the target verifies the current one (post-verify)", needs_draft_model=True),
    **{name: learned_entry(kind) for name, kind in LEARNED.items()},  # eagle, medusa, hydra, clover, kangaroo, ppd
    "eagle_fullvocab": DrafterEntry(partial(EagleDrafter, full_vocab=True), "eagle drafting through the target's "
                                    "whole LM head (against its trimmed draft vocabulary)", scored=True, needs_target=True),
    "medusa_online": DrafterEntry(partial(OnlineAdaptDrafter, kind="medusa"), "medusa whose heads keep learning "
                                  "from the target's verified outputs while serving (Online Speculative Decoding)",
                                  scored=True, needs_target=True),
    "medusa_online_zo": DrafterEntry(partial(OnlineAdaptDrafter, kind="medusa", update="zo"), "medusa_online "
                                     "with forward-only (SPSA / MeZO) updates", scored=True, needs_target=True),
    "hydra_online": DrafterEntry(partial(OnlineAdaptDrafter, kind="hydra"), "hydra whose heads keep learning "
                                 "from the target's verified outputs while serving", scored=True, needs_target=True),
    "swift": DrafterEntry(SwiftDrafter, "the target with layers skipped drafts chains, the skipped set searched "
                          "on the fly (SWIFT)", scored=True, needs_target=True),
    "del": DrafterEntry(DelDrafter, "the target's first layers and its LM head draft chains, exit layer and "
                        "length chosen per context from tracked per-layer acceptance (DEL)", scored=True,
                        needs_target=True),
    "quant_self": DrafterEntry(QuantSelfDrafter, "an int4 weight-only copy of the target drafts chains over the "
                               "target's cache (QSpec-style), a chain found earlier in the text ending with "
                               "what followed it", scored=True, needs_target=True),
    "lookahead": DrafterEntry(LookaheadDrafter, "Lookahead decoding: Jacobi iterates in the verification forward "
                              "fill an n-gram pool whose n-grams at the root are verified (training-free)",
                              scored=True, needs_target=True),
    "lookahead_fixed": DrafterEntry(partial(LookaheadDrafter, adaptive=False), "lookahead with its window in "
                                    "every step, as in the paper (no window switch)", scored=True, needs_target=True),
    "kv_draft": DrafterEntry(KVDraftDrafter, "lossless long context: the target (an int4 copy of float weights) drafts reading "
                             "a compressed view of the cache (TriForce-style): sinks and a recent window, with "
                             "snapkv, quest, duo, tidal, tokenselect or double_sparsity's choice", scored=True, needs_target=True),
}



def register_learned(name: str, kind: LearnedKind) -> None:
    """Add a learned drafting method at run time: its head files load, ``name`` is a method."""
    LEARNED[name] = kind
    DRAFTERS[name] = learned_entry(kind)


__all__ = [
    "DRAFTERS",
    "AdedDrafter",
    "AutoDrafter",
    "AutoregressiveDrafter",
    "BiLDDrafter",
    "CrossVocabDrafter",
    "DelDrafter",
    "DraftModelDrafter",
    "Drafter",
    "DrafterEntry",
    "EagleDrafter",
    "HydraDrafter",
    "KVDraftDrafter",
    "KangarooDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "MixDrafter",
    "NgramDrafter",
    "OnlineAdaptDrafter",
    "PPDDrafter",
    "PearlDrafter",
    "QuantSelfDrafter",
    "RecyclingDrafter",
    "SpecDecPPDrafter",
    "StandDrafter",
    "SuffixDrafter",
    "SuffixMergedDrafter",
    "SwiftDrafter",
]
