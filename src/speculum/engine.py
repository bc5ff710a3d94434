"""The decode loop: prefill, then draft -> size -> verify -> commit -> update until a stop.

The engine knows no method by name: a :class:`~speculum.drafters.base.Drafter` proposes a
:class:`~speculum.tree.DraftTree`, the :class:`~speculum.tree_sizing.TreeSizer` trims it to what
pays on this hardware, the runner (:mod:`speculum.runners`) scores ``[root] + tree`` in one forward
pass, the :class:`~speculum.verify.Verifier` picks the accepted path and the bonus token, and the
runner commits them to the KV cache. A constraint's work sits behind one
:class:`~speculum.constrain.guide.Guide`; stops are :class:`~speculum.stops.Stops`'.

Words, once for the whole package:

- *committed*: tokens that are part of the output (or the prompt). Every committed token except
  the newest has its KV entry in the cache; that newest one is the *root*.
- *root*: the last committed token. Its KV entry is not yet cached; each step feeds it first, so
  prefill runs over ``prompt[:-1]`` and the root's logits predict the first new token.
- *drafted*: the tokens of the tree hung below the root (their parents are drafted tokens or the root).
- *pending*: the KV entries a forward wrote for the root and every drafted token; they stay
  pending until the commit keeps some of them and the next forward overwrites the rest.
- *accepted*: drafted tokens the verifier keeps: a path down from the root whose every token is
  the target's choice (greedy) or passed the speculative-sampling test.
- *bonus*: the token the target itself produces after the accepted path (its argmax or a sample
  from the residual distribution): every step commits ``accepted + 1`` tokens, at least one.

Example, greedy: root "The", draft tree "cat sat" / "dog"; the target's argmaxes after "The",
"The cat" and "The cat sat" are "cat", "sat" and "on": "cat" and "sat" are accepted, "on" is the
bonus, and the step commits three tokens with one forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .constrain.guide import guide_for
from .constrain.matcher import Grammar, compile_constraint
from .drafters.base import Drafter
from .errors import SpeculumError
from .result import GenerationResult, StepStats
from .runners import PolicyRunner, runner_for
from .sampling import SamplingParams
from .stops import Stops, cut_at_stop
from .tree_sizing import TreeSizer
from .verify import Verifier

__all__ = ["Engine", "GenerationResult", "StepStats", "check_prompt_fits", "cut_at_stop", "default_eos_ids"]


class Engine:
    """Speculative decoding with one target model and one drafter.

    Args:
        runner: the target model's runner (or a transformers model: its :func:`runner_for` runner).
        drafter: proposes draft trees; ``AutoregressiveDrafter`` gives plain decoding.
        tokenizer: needed for stop strings, constraints and ``text`` in results.
        max_tree: upper bound on drafted nodes per step.
        verifier_cls: the acceptance rule (tests swap in deliberately broken ones).
        sizer: trims each scored tree to the size that pays on this hardware
            (:class:`~speculum.tree_sizing.TreeSizer`); ``None`` verifies trees as drafted.
        kv_policy: a :class:`~speculum.kv.KVPolicy` (eviction, quantization or sparse reads), plugged
            into the runner (:class:`~speculum.runners.PolicyRunner`). None keeps the whole cache (exact).
        chains_only: verify only each tree's best root path (:meth:`~speculum.tree.DraftTree.best_chain`):
            with a ``fixed_rows`` native runner, bfloat16 output then does not depend on what was drafted.
    """

    def __init__(self, runner, drafter: Drafter, tokenizer=None, eos_token_ids: Sequence[int] | None = None,
                 max_tree: int = 64, verifier_cls: type[Verifier] = Verifier, sizer: TreeSizer | None = None,
                 kv_policy=None, chains_only: bool = False):
        runner = runner_for(runner) if isinstance(runner, torch.nn.Module) else runner
        self.runner = PolicyRunner(runner, kv_policy) if kv_policy is not None else runner
        self.drafter, self.tokenizer = drafter, tokenizer
        self.max_tree, self.verifier_cls, self.sizer = max_tree, verifier_cls, sizer
        self.chains_only = chains_only
        if eos_token_ids is None:
            eos_token_ids = default_eos_ids(self.runner, tokenizer)
        self.eos_ids = set(eos_token_ids)

    def compile(self, spec, close_reserve: int = 0) -> Grammar:
        """Compile a :class:`~speculum.constrain.ConstraintSpec` for this engine's tokenizer and logits
        (``close_reserve``: the budget closer, see :class:`~speculum.constrain.Grammar`)."""
        if self.tokenizer is None:
            raise SpeculumError("constrained decoding needs the engine's tokenizer")
        return compile_constraint(spec, self.tokenizer, self.runner.vocab_size, self.eos_ids, close_reserve)

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int = 128,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), seed: int | None = None,
               grammar: Grammar | None = None, query_start: int | None = None) -> Iterator[list[int]]:
        """Yield lists of newly committed token ids; ``return`` the :class:`GenerationResult`.

        Use :meth:`generate` unless you need the tokens as they are accepted. ``grammar``
        constrains the output (:class:`~speculum.constrain.Grammar`, compiled for this tokenizer).
        ``query_start`` (with a KV policy): the policy compresses ``prompt[:query_start]`` (the
        context) before the rest (the question) is appended, query-agnostic; by default it sees the
        whole prompt at prefill.
        """
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, max_new_tokens)
        runner, drafter = self.runner, self.drafter
        generator = self._generator(sampling, seed)
        verifier = self.verifier_cls(sampling, generator, key=self._sampling_key(generator, seed))
        guide = guide_for(grammar, runner.vocab_size)
        stops = Stops(self.tokenizer, self.eos_ids, stop, max_new_tokens, runner.max_length)

        t0 = time.perf_counter()
        cache = runner.new_cache(len(prompt) + max_new_tokens + self.max_tree + 1)
        runner.prefill(cache, prompt[:-1], query_start=query_start)
        drafter.reset(prompt, sampling, verifier.generator)
        prefill_s = time.perf_counter() - t0

        tokens, generated, steps, reason = list(prompt), [], [], None
        while reason is None:
            t_a = time.perf_counter()
            room = max(min(self.max_tree, max_new_tokens - len(generated) - 1, runner.max_length - len(tokens) - 1), 0)
            tree = drafter.propose(tokens, room)  # draft
            if len(tree) > room:
                raise RuntimeError(f"{drafter.name} drafted {len(tree)} nodes with a budget of {room}")
            sized = self.sizer is not None and tree.scores is not None
            tree = guide.shape(tree, room)
            if sized:  # size
                tree = self.sizer.select(tree, cache.length)
            if self.chains_only:
                tree = tree.best_chain()
            tree = guide.bind(tree)
            t_b = time.perf_counter()
            logits = guide.mask(runner.forward(cache, tokens[-1], tree).logits)  # verify
            acc = verifier.accept(tree, logits, position=len(tokens))
            t_c = time.perf_counter()
            runner.commit(cache, [0] + [i + 1 for i in acc.path])  # commit
            left = min(max_new_tokens - len(generated), runner.max_length - len(tokens))
            new, reason = stops.extend(generated, tokens, *guide.close(acc.tokens, left))
            guide.commit(new)
            if reason is None:
                drafter.update(tokens, tree, acc, logits)  # update
            steps.append(StepStats(len(tree), len(acc.path), len(new), t_b - t_a, t_c - t_b,
                                   time.perf_counter() - t_c, guide.forced, guide.mask_s))
            if new:
                yield new
        drafter.finish(tokens)
        return GenerationResult(len(prompt), generated, stops.final_text(generated, reason), reason,
                                time.perf_counter() - t0, prefill_s, len(steps), steps, cache.peak_bytes)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (), seed: int | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 grammar: Grammar | None = None, query_start: int | None = None) -> GenerationResult:
        """Run to a stop and return the result; ``on_tokens`` receives each committed chunk."""
        it = self.stream(prompt_ids, max_new_tokens, sampling, stop, seed, grammar, query_start)
        while True:
            try:
                chunk = next(it)
            except StopIteration as done:
                return done.value
            if on_tokens is not None:
                on_tokens(chunk)

    def _generator(self, sampling: SamplingParams, seed: int | None) -> torch.Generator | None:
        """The request's random numbers (None when greedy): seeded by ``seed``, or randomly."""
        if sampling.greedy:
            return None
        gen = torch.Generator(device=self.runner.device)
        gen.manual_seed(seed if seed is not None else int(torch.seed() % (1 << 62)))
        return gen

    @staticmethod
    def _sampling_key(generator: torch.Generator | None, seed: int | None) -> int | None:
        """The keyed-sampling key (:mod:`speculum.verify`): the seed itself, so that a seeded request
        samples the same text under every drafter; without a seed, one draw from ``generator``."""
        if generator is None:
            return None
        if seed is not None:
            return seed
        return int(torch.randint(0, 1 << 62, (), generator=generator))

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise SpeculumError("the prompt is empty")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpeculumError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
        check_prompt_fits(len(prompt), self.runner.max_positions)
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise SpeculumError(f"prompt token ids must lie in [0, {vocab})")


def check_prompt_fits(prompt_tokens: int, max_positions: int) -> None:
    """Raise :class:`SpeculumError` unless a prompt of ``prompt_tokens`` leaves room for one new token."""
    if prompt_tokens >= max_positions:
        raise SpeculumError(f"the prompt has {prompt_tokens} tokens but the model's context is {max_positions}")


def default_eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config of ``model`` (a transformers model or a runner) and the
    tokenizer, merged."""
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
