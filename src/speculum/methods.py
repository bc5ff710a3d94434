"""Decoding methods by name: speculum's engine methods and transformers' reference baselines.

Every method has ``run(prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens) ->
GenerationResult`` so that the CLI and the benchmark treat them alike.

=============== ==================================================================================
``ar``          plain decoding through speculum's engine (the baseline for ``speedup_vs_ar``)
``ngram``       prompt lookup with an incremental index and adaptive draft length
``ngram_tree``  prompt lookup drafting a tree from several matches
``suffix``      SuffixDecoding: suffix tries over this request and previous outputs
``recycling``   Token Recycling: an adjacency matrix of recent top-k candidates, grown into a tree
``mix``         suffix and recycling candidates merged into one tree
``auto``        a bandit over mix / ngram / none by measured tokens per second
``draft_model`` a smaller model with the same tokenizer drafts chains (needs ``draft_model=``)
``hf``          ``model.generate`` (transformers' own plain decoding; ``speedup_vs_hf``)
``hf_pld``      ``model.generate(prompt_lookup_num_tokens=10)``
``hf_assisted`` ``model.generate(assistant_model=draft)`` (needs ``draft_model=``)
=============== ==================================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .calibrate import load_or_measure
from .drafters.ar import AutoregressiveDrafter
from .drafters.auto import AutoDrafter
from .drafters.draft_model import DraftModelDrafter, check_same_tokenizer
from .drafters.mix import MixDrafter
from .drafters.ngram import NgramDrafter
from .drafters.recycling import RecyclingDrafter
from .drafters.suffix import SuffixDrafter
from .engine import Engine, GenerationResult, cut_at_stop, default_eos_ids
from .errors import SpeculumError
from .runner import HFRunner, runner_for, weights_released
from .sampling import SamplingParams
from .tree_sizing import CostModel, TreeSizer

ENGINE_METHODS = ("ar", "ngram", "ngram_tree", "suffix", "recycling", "mix", "auto", "draft_model")
# drafters whose trees carry scores: the engine sizes them to the hardware's calibrated cost curve
SIZED_METHODS = ("suffix", "recycling", "mix", "auto")
HF_METHODS = ("hf", "hf_pld", "hf_assisted")
METHODS = ENGINE_METHODS + HF_METHODS
NEEDS_DRAFT = ("draft_model", "hf_assisted")


class EngineMethod:
    """A speculum engine with one drafter."""

    def __init__(self, name: str, engine: Engine):
        self.name, self.engine = name, engine

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
            stop: Sequence[str] = (), seed: int | None = None,
            on_tokens: Callable[[list[int]], None] | None = None, grammar=None) -> GenerationResult:
        return self.engine.generate(prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens, grammar)

    def compile(self, spec, close_reserve: int = 0):
        """A :class:`~speculum.constrain.Grammar` for ``spec`` (pass it to :meth:`run` as ``grammar``)."""
        return self.engine.compile(spec, close_reserve)


class HFMethod:
    """transformers ``generate`` as a reference; counts target forward passes with a hook."""

    def __init__(self, name: str, model, tokenizer, assistant=None, prompt_lookup: int | None = None):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.assistant, self.prompt_lookup = assistant, prompt_lookup
        self.eos_ids = default_eos_ids(model, tokenizer)
        self._calls = 0
        self._first_done: float | None = None

    def _count(self, *args):
        """Forward hook: counts target forwards and notes when the first one (the prefill) ended."""
        self._calls += 1
        if self._first_done is None:
            self._first_done = time.perf_counter()

    def compile(self, spec, close_reserve: int = 0):
        from .constrain import Grammar

        width = self.model.get_output_embeddings().weight.shape[0]
        return Grammar(spec, self.tokenizer, width, self.eos_ids, close_reserve)

    def run(self, prompt_ids, max_new_tokens=128, sampling=None, stop=(), seed=None, on_tokens=None,
            grammar=None):
        from transformers import GenerationConfig

        sampling = sampling or SamplingParams()
        if not prompt_ids:
            raise SpeculumError("the prompt is empty")
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not sampling.greedy,
            eos_token_id=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
            else self.eos_ids[0],
        )
        if not sampling.greedy:
            cfg.temperature, cfg.top_k, cfg.top_p = sampling.temperature, sampling.top_k or None, sampling.top_p
        if self.prompt_lookup:
            cfg.prompt_lookup_num_tokens = self.prompt_lookup
        if stop:
            cfg.stop_strings = list(stop)
        kwargs = {"generation_config": cfg, "tokenizer": self.tokenizer}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        if grammar is not None:
            from transformers import LogitsProcessorList

            from .constrain.hf_processor import GrammarLogitsProcessor

            processor = GrammarLogitsProcessor(grammar, len(prompt_ids), max_new_tokens if sampling.greedy else None)
            kwargs["logits_processor"] = LogitsProcessorList([processor])
        if seed is not None:
            torch.manual_seed(seed)
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(prompt_ids)], device=device)
        self._calls, self._first_done = 0, None
        hook = self.model.register_forward_hook(self._count)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            elapsed = time.perf_counter() - t0
        finally:
            hook.remove()
        new = out[0, ids.shape[1]:].tolist()
        reason = "eos" if new and new[-1] in self.eos_ids else "length"
        if grammar is not None and processor.closed and reason == "eos":
            reason = "closed"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if stop and cut_at_stop(text, stop) != text:
            reason = "stop"
            text = cut_at_stop(text, stop)
        if on_tokens is not None:
            on_tokens(new)
        prefill_s = self._first_done - t0 if self._first_done is not None else 0.0
        return GenerationResult(len(prompt_ids), new, text, reason, elapsed, prefill_s, self._calls)


def check_method(name: str, has_draft_model: bool) -> None:
    """Raise :class:`SpeculumError` for an unknown method or one that lacks its draft model (no weights needed)."""
    if name not in METHODS:
        raise SpeculumError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if name in NEEDS_DRAFT and not has_draft_model:
        raise SpeculumError(f"method {name!r} needs a draft model (--draft-model)")


def build_method(name: str, model, tokenizer, draft_model=None, draft_tokenizer=None,
                 runner: HFRunner | None = None, cost_model: CostModel | None = None, **options):
    """Make the method ``name`` for ``model``.

    Args:
        draft_model / draft_tokenizer: for ``draft_model`` and ``hf_assisted``.
        runner: share one target runner between several engine methods.
        cost_model: the forward-cost curve that sizes the trees of :data:`SIZED_METHODS`; by default
            the runner's calibrated curve (measured now, with a progress bar, if none is cached).
        options: drafter settings, e.g. ``max_draft=12`` for ``ngram``, ``num_draft=4`` for
            ``draft_model``, ``max_tree`` for the engine, ``kv_policy`` (a :class:`~speculum.kv.KVPolicy`).
    """
    check_method(name, draft_model is not None)
    if name in NEEDS_DRAFT:
        check_same_tokenizer(tokenizer, draft_tokenizer)
        if name == "draft_model":
            tw = model.get_output_embeddings().weight.shape[0]
            dw = draft_model.get_output_embeddings().weight.shape[0]
            if tw != dw:
                raise SpeculumError(f"draft model's logits are {dw} wide, the target's {tw}: not the same vocabulary")
    kv_policy = options.pop("kv_policy", None)
    if kv_policy is not None and name in HF_METHODS:
        raise SpeculumError(f"method {name!r} runs transformers' generate, which takes no speculum KV policy")
    if name in HF_METHODS and weights_released(model):
        raise SpeculumError(f"method {name!r} runs transformers' generate, but this model's layer weights were "
                            "released to the native runner; load the model again")
    if name == "hf":
        return HFMethod(name, model, tokenizer)
    if name == "hf_pld":
        return HFMethod(name, model, tokenizer, prompt_lookup=options.get("prompt_lookup_num_tokens", 10))
    if name == "hf_assisted":
        return HFMethod(name, model, tokenizer, assistant=draft_model)
    max_tree = options.pop("max_tree", 64)
    sized = options.pop("sized", name in SIZED_METHODS)
    runner = runner or runner_for(model)
    if name == "ar":
        drafter = AutoregressiveDrafter()
    elif name == "ngram":
        drafter = NgramDrafter(**options)
    elif name == "ngram_tree":
        drafter = NgramDrafter(**{"branches": 4, **options})
    elif name == "suffix":
        drafter = SuffixDrafter(**options)
    elif name == "recycling":
        drafter = RecyclingDrafter(**options)
    elif name == "mix":
        drafter = MixDrafter([SuffixDrafter(), RecyclingDrafter()], **options)
    elif name == "auto":
        drafter = AutoDrafter(**options)
    else:
        drafter = DraftModelDrafter(draft_model, **options)
    sizer = TreeSizer(cost_model or load_or_measure(runner, progress=True)) if sized else None
    engine = Engine(runner, drafter, tokenizer, max_tree=max_tree, sizer=sizer, kv_policy=kv_policy)
    return EngineMethod(name, engine)
