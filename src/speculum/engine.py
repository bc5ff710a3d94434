"""The decode loop: prefill, then draft -> size -> verify -> commit -> update until a stop.

The engine knows no method by name: a :class:`~speculum.drafters.base.Drafter` proposes a
:class:`~speculum.tree.DraftTree` (the engine cuts what hangs below an EOS node: it can never be
committed), the :class:`~speculum.tree_sizing.TreeSizer` trims it to what
pays on this hardware, the runner (:mod:`speculum.runners`) scores ``[root] + tree`` in one forward
pass, the :class:`~speculum.verify.Verifier` picks the accepted path and the bonus token, and the
runner commits them to the KV cache. A constraint's work sits behind one
:class:`~speculum.constrain.guide.Guide`; stops are :class:`~speculum.stops.Stops`'; a request's
repetition, frequency and presence penalties change every row's logits along its own tree path
before verification (:mod:`speculum.penalties`).

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

from .constrain.matcher import Grammar, compile_constraint
from .constrain.request_guide import guide_for
from .drafters.base import Drafter
from .errors import SpeculumError
from .penalties import Penalties
from .result import FinishReason, GenerationResult, StepStats, TokenLogprob
from .runners import runner_for
from .sampling import SamplingParams
from .stops import Stops, cut_at_stop
from .tree import DraftTree
from .tree_sizing import TreeSizer
from .verify import Verifier

__all__ = ["Decoding", "Engine", "GenerationResult", "StepStats", "check_prompt_fits", "cut_at_stop", "default_eos_ids", "step"]


class Engine:
    """Speculative decoding with one target model and one drafter.

    Args:
        runner: the target model's runner, as it will run (under a KV policy: a
            :class:`~speculum.runners.PolicyRunner`), or a transformers model (its :func:`runner_for` runner).
        drafter: proposes draft trees; ``AutoregressiveDrafter`` gives plain decoding.
        tokenizer: needed for stop strings, constraints and ``text`` in results.
        max_tree: upper bound on drafted nodes per step.
        verifier_cls: the acceptance rule (tests swap in deliberately broken ones).
        sizer: trims each scored tree to the size that pays on this hardware
            (:class:`~speculum.tree_sizing.TreeSizer`); ``None`` verifies trees as drafted.
        chains_only: verify only each tree's best root path (:meth:`~speculum.tree.DraftTree.best_chain`):
            with a ``fixed_rows`` native runner, bfloat16 output then does not depend on what was drafted.
    """

    def __init__(self, runner, drafter: Drafter, tokenizer=None, eos_token_ids: Sequence[int] | None = None,
                 max_tree: int = 64, verifier_cls: type[Verifier] = Verifier, sizer: TreeSizer | None = None,
                 chains_only: bool = False):
        self.runner = runner_for(runner) if isinstance(runner, torch.nn.Module) else runner
        self.drafter, self.tokenizer = drafter, tokenizer
        self.max_tree, self.verifier_cls, self.sizer = max_tree, verifier_cls, sizer
        self.chains_only = chains_only
        if eos_token_ids is None:
            eos_token_ids = default_eos_ids(self.runner, tokenizer)
        self.eos_ids = set(eos_token_ids)

    def compile(self, spec, close_reserve: int = 0, sampling: str = "mask", particles: int = 8) -> Grammar:
        """Compile a :class:`~speculum.constrain.ConstraintSpec` for this engine's tokenizer and logits
        (``close_reserve``: the budget closer; ``sampling``, ``particles``: how sampled requests meet
        it; see :class:`~speculum.constrain.Grammar`)."""
        if self.tokenizer is None:
            raise SpeculumError("constrained decoding needs the engine's tokenizer")
        return compile_constraint(spec, self.tokenizer, self.runner.vocab_size, self.eos_ids, close_reserve,
                                  sampling, particles)

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
        d = self.start(prompt_ids, max_new_tokens, sampling, stop, seed, grammar, query_start=query_start)
        while d.reason is None:
            new = self.step([d])[0]
            if new:
                yield new
        return d.finish()

    def start(self, prompt_ids: Sequence[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
              stop: Sequence[str] = (), seed: int | None = None, grammar: Grammar | None = None, *,
              cache=None, drafter: Drafter | None = None, prefill: bool = True,
              query_start: int | None = None) -> Decoding:
        """Begin a request: a :class:`Decoding` to advance with :meth:`step` (alone or beside others).

        ``cache``: an empty KV cache to decode into (a pool slot, for batching; default a new one);
        ``drafter``: this request's drafter (default the engine's; concurrent requests each need
        their own, :meth:`~speculum.drafters.base.Drafter.fork`). ``prefill=False`` leaves the
        prompt to :meth:`Decoding.prefill_some`, chunk by chunk.
        """
        sampling = sampling or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, max_new_tokens)
        generator = self._generator(sampling, seed)
        guide = guide_for(grammar, self.runner.vocab_size, sampling, generator, (tuple(prompt), id(self.runner)))
        # a drafter whose method changes the acceptance rule (BiLD's lossy rollback) names it
        rule = getattr(drafter or self.drafter, "verifier_cls", None) or self.verifier_cls
        verifier = rule(guide.verifier_params(sampling), generator, key=self._sampling_key(generator, seed))
        stops = Stops(self.tokenizer, self.eos_ids, stop, max_new_tokens, self.runner.max_length)
        d = Decoding(self, prompt, max_new_tokens, verifier, guide, stops, drafter or self.drafter, cache)
        if prefill:
            d.prefill_some(len(prompt), query_start)
        return d

    def step(self, decodings: Sequence[Decoding]) -> list[list[int]]:
        """One verification step for every decoding of this engine: see :func:`step`."""
        return step(decodings, self.sizer)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (), seed: int | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 grammar: Grammar | None = None, query_start: int | None = None) -> GenerationResult:
        """Run to a stop and return the result; ``on_tokens`` receives each committed chunk.

        A sampled request under a grammar compiled with ``sampling="awrs"`` runs the grammar's
        particles and returns the resampled one (:func:`~speculum.constrain.awrs.generate_particles`);
        ``on_tokens`` then receives its tokens at the end."""
        if grammar is not None and grammar.sampling == "awrs" and not (sampling or SamplingParams()).greedy:
            from .constrain.awrs import generate_particles

            out = generate_particles(self, prompt_ids, max_new_tokens, sampling, stop, seed, grammar,
                                     grammar.particles).result
            if on_tokens is not None and out.tokens:
                on_tokens(list(out.tokens))
            return out
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
        check_request(prompt, max_new_tokens, self.runner.max_positions)
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise SpeculumError(f"prompt token ids must lie in [0, {vocab})")


class Decoding:
    """One request in flight: its tokens, cache, drafter, verifier, guide and stops.

    Made by :meth:`Engine.start` and advanced by :meth:`Engine.step` (one step may serve several
    decodings in one forward); :meth:`finish` returns the :class:`GenerationResult`. ``reason`` is
    None while the request runs, then why it ended.
    """

    def __init__(self, engine: Engine, prompt: list[int], max_new_tokens: int, verifier: Verifier, guide,
                 stops: Stops, drafter: Drafter, cache=None):
        self.engine, self.runner = engine, engine.runner
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.verifier, self.guide, self.stops, self.drafter = verifier, guide, stops, drafter
        self.t0 = time.perf_counter()
        self.cache = cache if cache is not None else self.runner.new_cache(
            len(prompt) + max_new_tokens + engine.max_tree + 1)
        self.to_prefill = len(prompt) - 1 - self.cache.length  # prompt[:-1] goes to the cache first
        # setting up (a new cache is allocated and zeroed) is time before the first token, counted
        # with the prefill, not with decoding
        self.prefill_s = time.perf_counter() - self.t0
        self.tokens, self.generated, self.steps = list(prompt), [], []
        self.reason: FinishReason | None = None
        self.started = False  # prefilled and the drafter reset
        self.prompt_hidden: list[dict[int, torch.Tensor]] = []  # prefill chunks' hidden states, for the drafter
        self.scored = False  # whether this step's drafted tree came with node scores (before shaping)
        params = verifier.params
        self.penalties = Penalties(params, prompt, self.runner.vocab_size, self.runner.device) \
            if params.penalized else None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None

    @property
    def prefilled(self) -> bool:
        """The prompt is in the cache and the drafter has started: the decoding can step."""
        return self.started

    def prefill_some(self, limit: int, query_start: int | None = None) -> None:
        """Commit up to ``limit`` more prompt tokens to the cache; once all are in, the drafter starts."""
        take = self.next_chunk(limit, query_start is not None)
        t = time.perf_counter()
        hidden = None
        if take or (not self.started and self.cache.length == 0):  # a KV policy sets its state up even for none
            hidden = self.runner.prefill(self.cache, take, self.drafter.hidden_layers, query_start=query_start)
        self.chunk_done(len(take), time.perf_counter() - t, hidden)

    def next_chunk(self, limit: int, whole: bool = False) -> list[int]:
        """The next at most ``limit`` prompt tokens to prefill (all that are left when ``whole``, or
        when the runner prefills only whole prompts: a KV policy's)."""
        at = self.cache.length
        if whole or not self.runner.chunked_prefill:
            limit = self.to_prefill
        return self.prompt[at:at + min(limit, self.to_prefill)]

    def chunk_done(self, n: int, seconds: float = 0.0, hidden: dict[int, torch.Tensor] | None = None) -> None:
        """``n`` more prompt tokens were committed (in ``seconds``; ``hidden``: their hidden states
        ``{layer: [n, D]}`` for a drafter that reads them); the drafter starts after the last."""
        self.to_prefill -= n
        self.prefill_s += seconds
        if self.drafter.hidden_layers and n:
            self.prompt_hidden.append(hidden)
        if self.to_prefill == 0 and not self.started:
            # the drafter's start reads the prompt (a head's pass over its hidden states, a
            # compressed view's selection): prompt processing, timed with the prefill
            t = time.perf_counter()
            self.drafter.end_ids = frozenset(self.stops.eos_ids)
            self.drafter.siblings = self.verifier.siblings
            self.drafter.reset(self.prompt, self.verifier.params, self.verifier.generator)
            if self.drafter.reads_cache:
                self.drafter.see_cache(self.cache)
            self.started = True
            if self.drafter.hidden_layers and self.prompt_hidden:
                parts, self.prompt_hidden = self.prompt_hidden, []
                self.drafter.see_hidden({i: torch.cat([p[i] for p in parts]) for i in parts[0]})
            self.prefill_s += time.perf_counter() - t

    def draft(self, sequences: int = 1) -> DraftTree:
        """The drafter's tree for this step, shaped by the guide (at most the room left);
        ``sequences``: how many decoding sequences the step's forward serves."""
        e, runner = self.engine, self.runner
        left = self.max_new_tokens - len(self.generated) - 1
        self.room = max(min(e.max_tree, left, runner.max_length - len(self.tokens) - 1), 0)
        depth = runner.draft_depth(self.cache)  # a KV policy's next decision point (None: no limit)
        if depth == 0:
            self.room = 0
        self.drafter.see_batch(sequences)
        tree = self.drafter.propose(self.tokens, self.room)
        if len(tree) > self.room:
            raise RuntimeError(f"{self.drafter.name} drafted {len(tree)} nodes with a budget of {self.room}")
        tree = tree.cut_after(self.stops.eos_ids)  # nothing after an EOS can be committed: no rows for it
        if depth is not None:
            tree = tree.within_depth(depth)
        self.scored = tree.scores is not None
        return self.guide.shape(tree, self.room)

    def bind(self, tree: DraftTree) -> DraftTree:
        """The tree as verified: its best chain in the reproducible mode, bound to the guide."""
        if self.engine.chains_only:
            tree = tree.best_chain()
        return self.guide.bind(tree)

    def advance(self, tree: DraftTree, raw_logits: torch.Tensor, draft_s: float, verify_s: float,
                hidden: dict[int, torch.Tensor] | None = None, prompt_logits: torch.Tensor | None = None) -> list[int]:
        """Verify ``tree`` against its logits ``[len(tree) + 1, V]``, commit, update; the new tokens.
        ``hidden``: the forward's hidden states ``{layer: [len(tree) + 1, D]}`` for the drafter;
        ``prompt_logits``: its prompt rows' ``[e, V]`` (where they ran)."""
        t = time.perf_counter()
        guide, stops = self.guide, self.stops
        logits = guide.mask(raw_logits if self.penalties is None else self.penalties.apply(tree, raw_logits))
        acc = self.verifier.accept(tree, logits, position=len(self.tokens), hidden=hidden)
        verify_s += time.perf_counter() - t
        t_c = time.perf_counter()
        kept = [0] + [i + 1 for i in acc.path]  # the rows of the root and the accepted path
        self.runner.commit(self.cache, kept)
        left = min(self.max_new_tokens - len(self.generated), self.runner.max_length - len(self.tokens))
        new, self.reason = stops.extend(self.generated, self.tokens, *guide.close(acc.tokens, left))
        if self.logprobs is not None:
            source = raw_logits if self.verifier.params.logprobs_mode == "raw" else logits
            self.logprobs += emitted_logprobs(source, kept, acc.tokens, new, self.verifier.params)
        guide.commit(new)
        if self.penalties is not None:
            self.penalties.commit(new)
        if self.reason is None:
            if self.drafter.hidden_layers:
                rows = torch.tensor(kept, device=raw_logits.device)
                self.drafter.see_hidden({i: hidden[i].index_select(0, rows) for i in self.drafter.hidden_layers})
            if tree.prompts is not None:
                self.drafter.see_prompt_logits(tree, acc, prompt_logits)
            self.drafter.update(self.tokens, tree, acc, logits)
        self.steps.append(StepStats(len(tree), len(acc.path), len(new), draft_s, verify_s,
                                    time.perf_counter() - t_c, guide.forced, guide.mask_s))
        return new

    def cancel(self) -> None:
        """End the request early (its client went away); :meth:`finish` still reports what was made."""
        if self.reason is None:
            self.reason = FinishReason.CANCELLED

    def finish(self) -> GenerationResult:
        """The result; the drafter learns from the whole request (cross-request drafters)."""
        self.drafter.finish(self.tokens)
        reason = self.reason or FinishReason.CANCELLED
        return GenerationResult(len(self.prompt), self.generated, self.stops.final_text(self.generated, reason),
                                reason, time.perf_counter() - self.t0, self.prefill_s, len(self.steps),
                                self.steps, self.cache.peak_bytes, self.logprobs, self.verifier.name,
                                self.verifier.lossy)


def emitted_logprobs(logits: torch.Tensor, rows: list[int], verified: list[int], emitted: list[int],
                     params: SamplingParams) -> list[TokenLogprob]:
    """The log-probabilities of a step's ``emitted`` tokens: token ``j`` from row ``rows[j]`` of
    ``logits [n + 1, V]`` (the root's row, then the accepted path's), which predicts the position
    after ``verified[:j]``; that row holds its distribution only while ``emitted[:j]`` equals
    ``verified[:j]`` (a grammar's closer may replace the tail), else the token gets None."""
    same = 0
    while same < min(len(emitted), len(verified)) and emitted[same] == verified[same]:
        same += 1
    scored = min(len(emitted), len(rows), same + 1)
    out = [TokenLogprob(t, None) for t in emitted[scored:]]
    if not scored:
        return out
    lp = params.log_probs(logits.index_select(0, torch.tensor(rows[:scored], device=logits.device)))  # [m, V]
    own = lp.gather(1, torch.tensor(emitted[:scored], device=lp.device)[:, None])[:, 0].tolist()
    top = lp.topk(params.logprobs, dim=-1) if params.logprobs else None
    scored_part = [TokenLogprob(t, own[j], [] if top is None else
                                list(zip(top.indices[j].tolist(), top.values[j].tolist())))
                   for j, t in enumerate(emitted[:scored])]
    return scored_part + out


def step(decodings: Sequence[Decoding], sizer: TreeSizer | None = None,
         prefills: Sequence[tuple[Decoding, list[int]]] = ()) -> list[list[int]]:
    """One verification step for every decoding (all prefilled, none finished, all on one runner;
    their engines and drafters may differ): draft, size, one forward over all of them
    (:meth:`~speculum.runners.base.RunnerBase.forward_batch`), verify, commit, update. Returns each
    one's newly committed tokens. ``sizer`` trims one decoding's tree for its own speed, or several
    decodings' trees together for the batch's (:meth:`~speculum.tree_sizing.TreeSizer.select_batch`).
    ``prefills``: ``(decoding, prompt chunk)`` pairs of decodings still prefilling, whose chunks
    ride in the same forward (:meth:`Decoding.next_chunk`)."""
    t_a = time.perf_counter()
    trees = [d.draft(len(decodings)) for d in decodings]
    if sizer is not None:
        if len(decodings) == 1:
            if decodings[0].scored:
                trees = [sizer.select(trees[0], decodings[0].cache.length)]
        else:
            trees = sizer.select_batch(trees, [d.cache.length for d in decodings])
    trees = [d.bind(t) for d, t in zip(decodings, trees)]
    t_b = time.perf_counter()
    runner = (decodings or [p[0] for p in prefills])[0].runner
    caches = [d.cache for d in decodings]
    roots = [d.tokens[-1] for d in decodings]
    layers = sorted({i for d in list(decodings) + [p[0] for p in prefills] for i in d.drafter.hidden_layers}
                    | {i for d in decodings for i in d.verifier.hidden_layers})
    if len(decodings) == 1 and not prefills:
        outs = [runner.forward(caches[0], roots[0], trees[0], layers)]
    else:
        outs = runner.forward_batch(caches, roots, trees, [(d.cache, ids) for d, ids in prefills], layers)
    t_c = time.perf_counter()
    for (d, ids), o in zip(prefills, outs[len(decodings):]):
        d.chunk_done(len(ids), t_c - t_b, o.hidden)
    return [d.advance(t, o.logits, t_b - t_a, t_c - t_b, o.hidden, o.prompt_logits)
            for d, t, o in zip(decodings, trees, outs)]


def check_request(prompt: list[int], max_new_tokens: int, max_positions: int) -> None:
    """Raise :class:`SpeculumError` for an empty ``prompt``, a ``max_new_tokens`` that is not a positive
    integer, or a prompt that leaves no room in the context."""
    if not prompt:
        raise SpeculumError("the prompt is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpeculumError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    check_prompt_fits(len(prompt), max_positions)


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
