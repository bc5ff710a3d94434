"""The decode loop: prefill, then propose -> verify -> accept -> commit -> update until a stop.

The engine knows no method by name: a :class:`~speculum.drafters.base.Drafter` proposes a
:class:`~speculum.tree.DraftTree`, the :class:`~speculum.runner.HFRunner` scores ``[root] + tree``
in one forward pass, the :class:`~speculum.verify.Verifier` picks the accepted path and the bonus
token, and the :class:`~speculum.cache.KVCache` keeps the accepted entries.

Cache invariant: every committed token except the newest (the *root*) has its KV entry in the
cache. Prefill therefore runs over ``prompt[:-1]`` and each step feeds the root first.

Constrained decoding (``grammar=``): tokens the grammar forces lead the draft, with the drafter's
tree merged below them (jump-forward), drafted tokens the grammar forbids are pruned, and every verified row of
logits is masked with the grammar state at its node, so the verifier accepts and samples from the
constrained distribution: greedy output equals plain constrained decoding token for token.

Stops: an EOS token, ``max_new_tokens``, a stop string or the model's context length. A stop
inside an accepted draft ends generation exactly there: later accepted tokens are discarded.
A grammar compiled with ``close_reserve`` ends an output the budget would cut with the grammar's
shortest completion instead (finish reason ``"closed"``; see :class:`~speculum.constrain.Grammar`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .constrain.matcher import Grammar, graft_forced, mask_logits, restrict_draft_probs
from .drafters.base import Drafter
from .errors import SpeculumError
from .runner import runner_for
from .sampling import SamplingParams
from .tree import DraftTree
from .tree_sizing import TreeSizer
from .verify import Verifier


@dataclass
class StepStats:
    """One target forward: how many tokens were drafted and accepted, and where the time went."""

    drafted: int
    accepted: int  # drafted tokens accepted (the bonus token is not counted)
    committed: int  # tokens added to the output by this step (accepted + bonus, after stop truncation)
    draft_s: float
    verify_s: float
    other_s: float
    forced: int = 0  # drafted tokens the grammar forced (jump-forward), included in ``drafted``
    mask_s: float = 0.0  # grammar work: pruning the tree and computing the masks (in draft_s)


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]  # generated token ids (an EOS that ended generation included)
    text: str  # generated text, stop string excluded
    finish_reason: str  # "eos" | "length" | "stop" | "context"
    time_s: float  # prefill + decode wall time
    prefill_s: float
    forwards: int  # target forward passes that produced tokens (engine: one per step)
    steps: list[StepStats] = field(default_factory=list)  # per-step detail (engine methods only)
    kv_bytes: int = 0  # the most bytes the KV cache held (committed entries; 0 where not measured)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "new_tokens": self.new_tokens,
            "time_s": round(self.time_s, 4),
            "tok_s": round(self.tok_s, 3),
            "mean_accepted": round(self.mean_accepted, 4),
            "steps": self.forwards,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "drafted": sum(s.drafted for s in self.steps),
            "accepted": sum(s.accepted for s in self.steps),
            "time_draft_s": round(sum(s.draft_s for s in self.steps), 4),
            "time_verify_s": round(sum(s.verify_s for s in self.steps), 4),
            "time_other_s": round(sum(s.other_s for s in self.steps), 4),
            "forced": sum(s.forced for s in self.steps),
            "time_mask_s": round(sum(s.mask_s for s in self.steps), 4),
            "kv_bytes": self.kv_bytes,
        }


class _StopChecker:
    """Finds where generation must end inside a freshly committed run of tokens."""

    def __init__(self, tokenizer, eos_ids: set[int], stop: Sequence[str]):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, eos_ids, [s for s in stop if s]
        if self.stop and tokenizer is None:
            raise SpeculumError("stop strings need a tokenizer")

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""

    def check(self, generated: list[int], new_from: int) -> tuple[int, str | None]:
        """Return ``(keep, reason)``: keep ``generated[:keep]``; reason is None when nothing stops."""
        for i in range(new_from, len(generated)):
            if generated[i] in self.eos_ids:
                generated_upto = i + 1
                return (self._stop_in(generated[:generated_upto], new_from) or (generated_upto, "eos"))
        return self._stop_in(generated, new_from) or (len(generated), None)

    def _stop_in(self, generated: list[int], new_from: int) -> tuple[int, str] | None:
        if not self.stop:
            return None
        text = self.text(generated)
        if not any(s in text for s in self.stop):
            return None
        # the shortest prefix whose text contains a stop string (it ends inside the new tokens)
        for k in range(max(new_from, 1), len(generated) + 1):
            t = self.text(generated[:k])
            if any(s in t for s in self.stop):
                return k, "stop"
        return None

    def final_text(self, generated: list[int], reason: str) -> str:
        text = self.text(generated)
        return cut_at_stop(text, self.stop) if reason == "stop" else text


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    hits = [text.find(s) for s in stop if s and s in text]
    return text[:min(hits)] if hits else text


class Engine:
    """Speculative decoding with one target model and one drafter.

    Args:
        runner: the target model's runner (or a ``transformers`` model, wrapped in ``HFRunner``).
        drafter: proposes draft trees; ``AutoregressiveDrafter`` gives plain decoding.
        tokenizer: needed for stop strings and ``text`` in results.
        max_tree: upper bound on drafted nodes per step.
        verifier_cls: the acceptance rule (tests swap in deliberately broken ones).
        sizer: trims each scored tree to the size that pays on this hardware
            (:class:`~speculum.tree_sizing.TreeSizer`); ``None`` verifies trees as drafted.
        kv_policy: a :class:`~speculum.kv.KVPolicy` (eviction, quantization or sparse reads); the
            engine prefills through it and calls its ``after_step`` after each commit. None keeps
            the whole cache (exact).
    """

    def __init__(self, runner, drafter: Drafter, tokenizer=None, eos_token_ids: Sequence[int] | None = None,
                 max_tree: int = 64, verifier_cls: type[Verifier] = Verifier, sizer: TreeSizer | None = None,
                 kv_policy=None):
        self.verifier_cls = verifier_cls
        self.sizer = sizer
        self.runner = runner_for(runner) if isinstance(runner, torch.nn.Module) else runner
        self.kv_policy = kv_policy
        if kv_policy is not None:
            from .kv import PolicyRunner

            self.runner = PolicyRunner(self.runner, kv_policy)
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.max_tree = max_tree
        if eos_token_ids is None:
            eos_token_ids = default_eos_ids(getattr(self.runner, "model", None), tokenizer)
        self.eos_ids = set(eos_token_ids)

    def compile(self, spec, close_reserve: int = 0) -> Grammar:
        """Compile a :class:`~speculum.constrain.ConstraintSpec` for this engine's tokenizer and logits
        (``close_reserve``: the budget closer, see :class:`~speculum.constrain.Grammar`)."""
        if self.tokenizer is None:
            raise SpeculumError("constrained decoding needs the engine's tokenizer")
        return Grammar(spec, self.tokenizer, self.runner.vocab_size, sorted(self.eos_ids), close_reserve)

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
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(seed if seed is not None else int(torch.seed() % (1 << 62)))
        verifier = self.verifier_cls(sampling, gen)
        matcher = None
        if grammar is not None:
            if grammar.width != self.runner.vocab_size:
                raise SpeculumError(f"the grammar was compiled for logits {grammar.width} wide, "
                                    f"the model's are {self.runner.vocab_size}")
            matcher = grammar.matcher()
        stops = _StopChecker(self.tokenizer, self.eos_ids, stop)
        max_len = self.runner.max_positions

        t0 = time.perf_counter()
        cache = self.runner.new_cache(len(prompt) + max_new_tokens + self.max_tree + 1)
        split = len(prompt) - 1
        if self.kv_policy is not None and query_start is not None:
            split = min(max(1, query_start), split)
        self.runner.prefill(cache, prompt[:split])
        self._append(cache, prompt[split:-1])
        self.drafter.reset(prompt, sampling, gen)
        prefill_s = time.perf_counter() - t0

        tokens = list(prompt)
        generated: list[int] = []
        steps: list[StepStats] = []
        reason = None
        closing = matcher is not None and grammar.close_reserve > 0
        while reason is None:
            t_a = time.perf_counter()
            room = max(min(self.max_tree, max_new_tokens - len(generated) - 1, max_len - len(tokens) - 1), 0)
            t_m = time.perf_counter()
            forced = matcher.forced(room) if matcher is not None else []
            mask_s = time.perf_counter() - t_m
            tree = self.drafter.propose(tokens, room)
            if len(tree) > room:
                raise RuntimeError(f"{self.drafter.name} drafted {len(tree)} nodes with a budget of {room}")
            scored = tree.scores is not None
            if forced:  # jump-forward: the grammar's forced tokens lead the draft
                tree = graft_forced(forced, tree, room)
            if matcher is not None:
                t_m = time.perf_counter()
                tree = matcher.prune(tree)
                mask_s += time.perf_counter() - t_m
            if self.sizer is not None and scored:
                tree = self.sizer.select(tree, cache.length)
            if matcher is not None:
                t_m = time.perf_counter()
                allowed = matcher.allowed(tree)  # [n + 1, V]
                tree = restrict_draft_probs(tree, allowed)
                mask_s += time.perf_counter() - t_m
            t_b = time.perf_counter()
            logits = self.runner.forward_tree(cache, tokens[-1], tree)
            if matcher is not None:
                logits = mask_logits(logits, allowed)
            acc = verifier.accept(tree, logits)
            t_c = time.perf_counter()
            cache.commit([0] + [i + 1 for i in acc.path])
            if self.kv_policy is not None:
                self.kv_policy.after_step(cache)
            step_tokens, closed = acc.tokens, False
            if closing:  # the budget closer: keep the model's tokens only while the grammar can still end in time
                t_m = time.perf_counter()
                left = min(max_new_tokens - len(generated), max_len - len(tokens))
                checked = max(0, len(step_tokens) - max(0, left - grammar.close_reserve))  # those in its zone
                found = matcher.close_within(step_tokens, left, checked) if checked else None
                if found is not None:
                    step_tokens, closed = step_tokens[:found[0]] + found[1], True
                mask_s += time.perf_counter() - t_m
            before = len(generated)
            generated.extend(step_tokens)
            keep, reason = stops.check(generated, before)
            if closed and reason == "eos":
                reason = "closed"
            if keep > max_new_tokens:
                keep, reason = max_new_tokens, "length"
            elif reason is None and keep == max_new_tokens:
                reason = "length"
            del generated[keep:]
            new = generated[before:]
            tokens.extend(new)
            if reason is None and len(tokens) >= max_len:
                reason = "context"
            if matcher is not None:
                matcher.commit(new)
            if reason is None:
                self.drafter.update(tokens, tree, acc, logits)
            t_d = time.perf_counter()
            steps.append(StepStats(len(tree), len(acc.path), len(new), t_b - t_a, t_c - t_b, t_d - t_c,
                                   len(forced), mask_s))
            if new:
                yield new
        self.drafter.finish(tokens)
        total = time.perf_counter() - t0
        kv_bytes = getattr(cache, "peak_bytes", 0) or cache.nbytes()
        return GenerationResult(len(prompt), generated, stops.final_text(generated, reason), reason,
                                total, prefill_s, len(steps), steps, kv_bytes)

    def _append(self, cache, ids: list[int], chunk: int = 64) -> None:
        """Commit ``ids`` after a prefill, as chains through the KV policy (the query-agnostic protocol)."""
        for a in range(0, len(ids), chunk):
            part = ids[a:a + chunk]
            self.runner.forward_tree(cache, part[0], DraftTree.chain(part[1:]))
            cache.commit()
            if self.kv_policy is not None:
                self.kv_policy.after_step(cache)

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
    """EOS ids from the model's generation config and the tokenizer, merged."""
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
