"""Decoding methods by name: speculum's engine methods (one per registered drafter) and transformers'
reference baselines.

Every method has ``run(prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens, grammar) ->
GenerationResult`` and ``compile(spec, close_reserve) -> Grammar``, so that the CLI, the server and
the benchmark treat them alike.

- Engine methods: the names of :data:`speculum.drafters.DRAFTERS` (``ar``, ``ngram``, ``suffix``,
  ``recycling``, ``auto``, ...). Each is an :class:`~speculum.engine.Engine` with that drafter; those
  whose trees carry scores are sized to the hardware's measured cost curve.
- ``hf``: ``model.generate`` (transformers' own plain decoding; ``speedup_vs_hf``);
  ``hf_pld``: ``model.generate(prompt_lookup_num_tokens=10)``; ``hf_assisted``:
  ``model.generate(assistant_model=draft)``, with transformers' universal assisted decoding when the
  draft model's tokenizer differs from the target's.
- ``llama_cpp``: llama.cpp (llama-cpp-python, ``make llama``) decoding greedily on the GGUF file the model
  was loaded from; ``llama_cpp_lookup``: the same with its prompt lookup decoding
  (``LlamaPromptLookupDecoding(num_pred_tokens=2)``, llama-cpp-python's advice for CPUs; option
  ``num_pred_tokens``).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .calibrate import calibration_key, load_or_measure
from .constrain.matcher import compile_constraint
from .drafters import DRAFTERS
from .drafters.draft_model import check_same_tokenizer, same_tokenizer
from .engine import Engine, GenerationResult, check_prompt_fits, check_request, default_eos_ids
from .errors import SpeculumError
from .result import FinishReason
from .runners import Runner, runner_for, under_policy, weights_released
from .sampling import SamplingParams
from .stops import Stops, cut_at_stop
from .tree_sizing import CostModel, TreeSizer
from .verify import Verifier
from .verify.judge import judge_rule
from .verify.rules import DEFAULT_RULE, verifier_class

ENGINE_METHODS = tuple(DRAFTERS)
# drafters whose trees carry scores: the engine sizes them to the hardware's calibrated cost curve
SIZED_METHODS = tuple(name for name, entry in DRAFTERS.items() if entry.scored)
HF_METHODS = ("hf", "hf_pld", "hf_assisted", "hf_compiled")
LLAMA_METHODS = ("llama_cpp", "llama_cpp_lookup")
METHODS = ENGINE_METHODS + HF_METHODS + LLAMA_METHODS
DRAFT_MODEL_METHODS = tuple(name for name, entry in DRAFTERS.items() if entry.needs_draft_model)
# engine methods whose draft model may have another tokenizer than the target's
ANY_TOKENIZER = tuple(name for name, entry in DRAFTERS.items() if entry.takes_tokenizers)
NEEDS_DRAFT = DRAFT_MODEL_METHODS + ("hf_assisted",)
STATIC_CACHE_SLOTS = 2048  # hf_compiled's static cache, at least


class EngineMethod:
    """A speculum engine with one drafter."""

    def __init__(self, name: str, engine: Engine):
        self.name, self.engine = name, engine

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
            stop: Sequence[str] = (), seed: int | None = None,
            on_tokens: Callable[[list[int]], None] | None = None, grammar=None) -> GenerationResult:
        return self.engine.generate(prompt_ids, max_new_tokens, sampling, stop, seed, on_tokens, grammar)

    def compile(self, spec, close_reserve: int = 0, sampling: str = "mask", particles: int = 8):
        """A :class:`~speculum.constrain.Grammar` for ``spec`` (pass it to :meth:`run` as ``grammar``)."""
        return self.engine.compile(spec, close_reserve, sampling, particles)


class HFMethod:
    """transformers ``generate`` as a reference; counts target forward passes with a hook."""

    def __init__(self, name: str, model, tokenizer, assistant=None, assistant_tokenizer=None,
                 prompt_lookup: int | None = None, static_cache: bool = False):
        """``static_cache``: transformers' static KV cache of 2048 slots (the next power of two for a
        longer request: one shape, so one compilation, serves most requests), with which ``generate``
        compiles the decoding forward (``torch.compile``, CUDA graphs) on a GPU: transformers' fastest
        path there. On a CPU ``generate`` does not compile it."""
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.static_cache = static_cache
        self.assistant, self.assistant_tokenizer, self.prompt_lookup = assistant, assistant_tokenizer, prompt_lookup
        self.eos_ids = default_eos_ids(model, tokenizer)
        self._calls = 0
        self._first_done: float | None = None

    def _count(self, *args):
        """Forward hook: counts target forwards and notes when the first one (the prefill) ended."""
        self._calls += 1
        if self._first_done is None:
            self._first_done = time.perf_counter()

    def compile(self, spec, close_reserve: int = 0, sampling: str = "mask", particles: int = 8):
        if sampling != "mask":
            raise SpeculumError(f"method {self.name!r} masks each step (a transformers logits processor): "
                                f"constraint sampling {sampling!r} needs a speculum method (ar, auto, ...)")
        width = self.model.get_output_embeddings().weight.shape[0]
        return compile_constraint(spec, self.tokenizer, width, self.eos_ids, close_reserve)

    def run(self, prompt_ids, max_new_tokens=128, sampling=None, stop=(), seed=None, on_tokens=None,
            grammar=None):
        from transformers import GenerationConfig

        sampling = sampling or SamplingParams()
        if not prompt_ids:
            raise SpeculumError("the prompt is empty")
        if sampling.frequency_penalty or sampling.presence_penalty or sampling.logprobs is not None:
            raise SpeculumError("transformers' generate here has no frequency or presence penalty and returns no "
                                "logprobs: use a speculum method (ar, auto, ...) for them")
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not sampling.greedy,
            eos_token_id=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
            else self.eos_ids[0],
        )
        if not sampling.greedy:
            cfg.temperature, cfg.top_k, cfg.top_p = sampling.temperature, sampling.top_k or None, sampling.top_p
        if sampling.repetition_penalty != 1.0:
            cfg.repetition_penalty = sampling.repetition_penalty
        if self.prompt_lookup:
            cfg.prompt_lookup_num_tokens = self.prompt_lookup
        if stop:
            cfg.stop_strings = list(stop)
        kwargs = {"generation_config": cfg, "tokenizer": self.tokenizer}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
            if self.assistant_tokenizer is not None:  # universal assisted decoding
                kwargs["assistant_tokenizer"] = self.assistant_tokenizer
        if grammar is not None:
            from transformers import LogitsProcessorList

            from .constrain.hf_processor import GrammarLogitsProcessor

            processor = GrammarLogitsProcessor(grammar, len(prompt_ids), max_new_tokens if sampling.greedy else None)
            kwargs["logits_processor"] = LogitsProcessorList([processor])
        if seed is not None:
            torch.manual_seed(seed)
        device = next(self.model.parameters()).device
        if self.static_cache:
            from transformers import StaticCache

            slots = max(STATIC_CACHE_SLOTS, 1 << (len(prompt_ids) + max_new_tokens - 1).bit_length())
            kwargs["past_key_values"] = StaticCache(config=self.model.config, max_cache_len=slots)
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
        reason = FinishReason.EOS if new and new[-1] in self.eos_ids else FinishReason.LENGTH
        if grammar is not None and processor.closed and reason == FinishReason.EOS:
            reason = FinishReason.CLOSED
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if stop and cut_at_stop(text, stop) != text:
            reason = FinishReason.STOP
            text = cut_at_stop(text, stop)
        if on_tokens is not None:
            on_tokens(new)
        prefill_s = self._first_done - t0 if self._first_done is not None else 0.0
        return GenerationResult(len(prompt_ids), new, text, reason, elapsed, prefill_s, self._calls)


def _llama_cpp():
    """The ``llama_cpp`` module, or a :class:`SpeculumError` that says how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise SpeculumError("methods llama_cpp and llama_cpp_lookup need llama-cpp-python: run `make llama` "
                            "(pip install -e '.[llama]'; it builds llama.cpp from source, minutes)") from None
    return llama_cpp


def gguf_path(model_name: str, method: str) -> str:
    """The GGUF file that ``model_name`` resolves to, or a :class:`SpeculumError` for ``method``."""
    from .models import resolve

    kind, where = resolve(model_name)
    if kind != "gguf":
        raise SpeculumError(f"method {method!r} runs llama.cpp, which reads GGUF files only; model "
                            f"{model_name!r} is a transformers model ({kind}): pass a .gguf file or a packaged alias")
    return where


class LlamaCppMethod:
    """llama.cpp (llama-cpp-python) greedy decoding of a GGUF file, as a reference.

    It takes the prompt's token ids as they are and stops as speculum's engine does (the same EOS ids,
    kept in the output; stop strings; the token budget), so its tokens compare with ``ar``'s. With
    ``lookup`` tokens, llama-cpp-python's prompt lookup decoding drafts each step
    (``LlamaPromptLookupDecoding``; it makes the model keep every position's logits). Each run starts
    from an empty KV cache, so its time includes the whole prefill. The context holds the longest
    request so far: a longer one rebuilds it first, outside the timed part. ``forwards`` counts llama.cpp's
    evaluations (the prefill included), as ``hf`` counts transformers' forwards.
    """

    def __init__(self, name: str, path: str, tokenizer, eos_ids: Sequence[int], max_length: int,
                 lookup: int | None = None):
        _llama_cpp()
        self.name, self.path, self.tokenizer, self.lookup = name, path, tokenizer, lookup
        self.eos_ids, self.max_length = set(eos_ids), max_length
        self._llm, self._n_ctx = None, 0
        self._evals, self._first_done = 0, None

    def _context(self, n: int):
        """A ``Llama`` whose context holds ``n`` positions (a power of two, at most the model's context)."""
        if self._llm is not None and n <= self._n_ctx:
            return self._llm
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if self._llm is not None:
            self._llm.close()
        self._n_ctx = min(max(512, 1 << (n - 1).bit_length()), self.max_length)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=self.lookup) if self.lookup else None
        threads = torch.get_num_threads()
        llm = Llama(model_path=self.path, n_ctx=self._n_ctx, n_batch=self._n_ctx, n_threads=threads,
                    n_threads_batch=threads, logits_all=False, draft_model=draft, verbose=False)
        evaluate = llm.eval

        def counted(tokens):  # generate() calls self.eval once per forward
            evaluate(tokens)
            self._evals += 1
            if self._first_done is None:
                self._first_done = time.perf_counter()

        llm.eval = counted
        self._llm = llm
        return llm

    def compile(self, spec, close_reserve: int = 0, sampling: str = "mask", particles: int = 8):
        raise SpeculumError(f"method {self.name!r} takes no grammar: use a speculum method (ar, auto, ...)")

    def run(self, prompt_ids, max_new_tokens=128, sampling=None, stop=(), seed=None, on_tokens=None,
            grammar=None):
        sampling = sampling or SamplingParams()
        if not sampling.greedy or sampling.repetition_penalty != 1.0 or sampling.frequency_penalty \
                or sampling.presence_penalty or sampling.logprobs is not None:
            raise SpeculumError(f"method {self.name!r} is greedy only and returns no logprobs: leave the "
                                "temperature at 0, the penalties and logprobs off")
        if grammar is not None:
            self.compile(grammar)
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, max_new_tokens, self.max_length)
        llm = self._context(len(prompt) + max_new_tokens)
        stops = Stops(self.tokenizer, self.eos_ids, stop, max_new_tokens, self._n_ctx)
        generated, tokens, reason = [], list(prompt), None
        llm.reset()  # n_tokens = 0: generate() keeps no prefix of the previous prompt
        self._evals, self._first_done = 0, None
        t0 = time.perf_counter()
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
            new, reason = stops.extend(generated, tokens, [int(token)])
            if new and on_tokens is not None:
                on_tokens(new)
            if reason is not None:
                break
        elapsed = time.perf_counter() - t0
        reason = reason or FinishReason.LENGTH
        prefill_s = self._first_done - t0 if self._first_done is not None else 0.0
        return GenerationResult(len(prompt), generated, stops.final_text(generated, reason), reason, elapsed,
                                prefill_s, self._evals)


def check_method(name: str, has_draft_model: bool) -> None:
    """Raise :class:`SpeculumError` for an unknown method or one that lacks its draft model (no weights needed)."""
    if name not in DRAFTERS and name not in HF_METHODS + LLAMA_METHODS:  # (DRAFTERS: learned ones registered since)
        raise SpeculumError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if name in NEEDS_DRAFT and not has_draft_model:
        raise SpeculumError(f"method {name!r} needs a draft model (--draft-model)")
    if name in LLAMA_METHODS:
        _llama_cpp()


def check_draft(name: str, model, tokenizer, draft_model, draft_tokenizer) -> None:
    """Raise :class:`SpeculumError` where ``draft_model`` cannot draft for ``model`` under method ``name``:
    ``draft_model`` needs the same vocabulary, ``cross_vocab`` takes any tokenizer; ``hf_assisted`` takes another tokenizer when
    transformers can map between them (universal assisted decoding needs the vocabularies' sizes
    to differ, which is how it tells the case apart)."""
    if name == "hf_assisted":
        sizes = [m.config.get_text_config().vocab_size for m in (model, draft_model)]
        if sizes[0] == sizes[1] and not same_tokenizer(tokenizer, draft_tokenizer):
            raise SpeculumError("hf_assisted: the draft model's tokenizer differs from the target's but its "
                                "vocabulary has the same size, which transformers' universal assisted decoding "
                                "cannot tell apart from a shared tokenizer")
        return
    if name in DRAFTERS and DRAFTERS[name].takes_tokenizers:
        if tokenizer is None or draft_tokenizer is None:
            raise SpeculumError(f"method {name!r} drafts through text: it needs the target's and the draft "
                                "model's tokenizers")
        return
    check_same_tokenizer(tokenizer, draft_tokenizer)
    tw = model.get_output_embeddings().weight.shape[0]
    dw = draft_model.get_output_embeddings().weight.shape[0]
    if tw != dw:
        raise SpeculumError(f"draft model's logits are {dw} wide, the target's {tw}: not the same vocabulary")


def build_method(name: str, model, tokenizer, draft_model=None, draft_tokenizer=None,
                 runner: Runner | None = None, cost_model: CostModel | None = None, **options):
    """Make the method ``name`` for ``model``.

    Args:
        draft_model / draft_tokenizer: for ``draft_model`` and ``hf_assisted``.
        runner: share one target runner between several engine methods (default: ``runner_for(model)``).
        cost_model: the forward-cost curve that sizes the trees of :data:`SIZED_METHODS`; by default
            the runner's calibrated curve, measured when the first tree is sized (saying so on stderr)
            if none is cached.
        options: drafter settings, e.g. ``max_draft=12`` for ``ngram``, ``num_draft=4`` for
            ``draft_model``, ``max_tree`` for the engine, ``kv_policy`` (a :class:`~speculum.kv.KVPolicy`),
            ``draft_head`` (a head file for the learned drafters, ``eagle``; default the shipped one),
            ``verify`` (a rule of :data:`~speculum.verify.rules.VERIFY_RULES`, default ``specinfer``),
            ``judge`` (a :class:`~speculum.verify.judge.JudgeHead` or its file: judge decoding, LOSSY).
    """
    check_method(name, draft_model is not None)
    if name in NEEDS_DRAFT:
        check_draft(name, model, tokenizer, draft_model, draft_tokenizer)
    kv_policy = options.pop("kv_policy", None)
    verifier_cls = verifier_class(options.pop("verify", None) or DEFAULT_RULE)
    judge, judge_threshold = options.pop("judge", None), options.pop("judge_threshold", None)
    if judge is not None:
        verifier_cls = judge_rule(judge, judge_threshold)
    if name not in ENGINE_METHODS and verifier_cls is not Verifier:
        raise SpeculumError(f"method {name!r} does not run speculum's verifier: --verify and --judge are for "
                            f"speculum's engine methods ({', '.join(ENGINE_METHODS[:3])}, ...)")
    if name in LLAMA_METHODS:
        from .models import context_length

        if kv_policy is not None:
            raise SpeculumError(f"method {name!r} runs llama.cpp, which takes no speculum KV policy")
        loaded_as = getattr(model, "speculum_name", None) or model.config.name_or_path
        if not loaded_as:
            raise SpeculumError(f"method {name!r} runs llama.cpp on the GGUF file the model was loaded from: "
                                "load it by name (speculum.load) from an alias or a .gguf file")
        path = gguf_path(loaded_as, name)
        # llama.cpp runs on the CPU here (no layers offloaded), where llama-cpp-python advises 2 (10 on GPUs)
        lookup = options.get("num_pred_tokens", 2) if name == "llama_cpp_lookup" else None
        return LlamaCppMethod(name, path, tokenizer, default_eos_ids(model, tokenizer),
                              context_length(model.config), lookup)
    if name in HF_METHODS:
        if kv_policy is not None:
            raise SpeculumError(f"method {name!r} runs transformers' generate, which takes no speculum KV policy")
        if getattr(model, "speculum_quant", None):
            raise SpeculumError(f"method {name!r} runs transformers' generate, which cannot run quantized weights "
                                f"(--weights {getattr(model, 'speculum_weights', 'gguf')}); load the model with "
                                "--weights float to compare with it")
        if weights_released(model):
            raise SpeculumError(f"method {name!r} runs transformers' generate, but this model's layer weights "
                                "were released to the native runner; load the model again")
        if name == "hf_pld":
            return HFMethod(name, model, tokenizer, prompt_lookup=options.get("prompt_lookup_num_tokens", 10))
        if name == "hf_assisted":
            other = not same_tokenizer(tokenizer, draft_tokenizer)  # universal assisted decoding
            return HFMethod(name, model, tokenizer, assistant=draft_model,
                            assistant_tokenizer=draft_tokenizer if other else None)
        return HFMethod(name, model, tokenizer, static_cache=name == "hf_compiled")
    entry = DRAFTERS[name]
    max_tree = options.pop("max_tree", entry.max_tree)
    sized = options.pop("sized", entry.scored)
    chains_only = options.pop("chains_only", False)
    runner = runner or runner_for(model)
    if runner.fixed_rows is not None:
        sized = False  # every step costs the same up to fixed_rows: nothing to size (and no calibration)
    if entry.needs_draft_model:
        options["draft_model"] = draft_model
    if entry.takes_tokenizers:
        options["target_tokenizer"], options["draft_tokenizer"] = tokenizer, draft_tokenizer
    draft_head = options.pop("draft_head", None)
    if entry.needs_target:
        options["target"], options["draft_head"] = model, draft_head
    if entry.remembers_arms:
        options.setdefault("memory_key", calibration_key(runner))
    drafter = entry.factory(**options)
    sizer = TreeSizer(cost_model or functools.partial(_calibrated, runner)) if sized else None
    runner = under_policy(runner, kv_policy)
    return EngineMethod(name, Engine(runner, drafter, tokenizer, max_tree=max_tree, sizer=sizer,
                                     chains_only=chains_only, verifier_cls=verifier_cls))


def _calibrated(runner):
    """The runner's cost curve; a first measurement on this machine says so on stderr."""
    return load_or_measure(runner, progress=True, announce=lambda: print(
        "speculum: measuring this machine's forward cost once, to size draft trees (cached for later runs)",
        file=sys.stderr))


def load_checked(model_name: str, methods: Sequence[str], draft_name: str | None = None, dtype=None,
                 device: str | None = None, runner: str = "auto", prompt: str | None = None,
                 chat: bool | None = None, weights: str | None = None):
    """``(model, tokenizer, draft, draft_tokenizer)`` for running ``methods``, after every check that
    needs no weights.

    A model's first load dequantizes it and prints progress; the mistakes that tokenizers and
    configurations reveal (an unknown method, a missing or incompatible draft model, a prompt longer
    than the context) are caught before it, so their one-line error is all the user sees.
    """
    from .loading import load, resolve_weights
    from .models import context_length, load_tokenizer_and_config, parse_dtype
    from .prompts import encode_prompt
    from .runners import use_runner

    parse_dtype(dtype)
    for name in methods:
        check_method(name, bool(draft_name))
        if name in LLAMA_METHODS:
            gguf_path(model_name, name)
    tok, config = load_tokenizer_and_config(model_name)
    weights = resolve_weights(model_name, weights, device, config)
    hf = [m for m in methods if m in HF_METHODS]
    if weights != "float" and hf:
        raise SpeculumError(f"{', '.join(hf)} run transformers' generate, which cannot run quantized weights; "
                            f"add --weights float (the model as transformers loads it), or leave them out")
    if prompt is not None:
        check_prompt_fits(len(encode_prompt(tok, prompt, chat)), context_length(config))
    draft_tok = None
    if draft_name:
        draft_tok, _ = load_tokenizer_and_config(draft_name)
        if any(m in DRAFT_MODEL_METHODS and m not in ANY_TOKENIZER for m in methods):
            check_same_tokenizer(tok, draft_tok)
    model, tok = load(model_name, dtype, device, tokenizer=tok, weights=weights)
    use_runner(model, runner)
    draft = None
    if draft_name:
        draft, draft_tok = load(draft_name, dtype, device, tokenizer=draft_tok, weights=weights if
                                weights == "float" else None)
        use_runner(draft, runner)
    return model, tok, draft, draft_tok
