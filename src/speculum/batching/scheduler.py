"""Continuous batching: many requests decoded together, one target forward per step.

A :class:`Batcher` owns a :class:`~speculum.cache.SlotPool` (one KV slot per running request) and
loops over :meth:`Batcher.step`:

1. **admit** waiting requests while a slot is free; a request whose prompt starts like a recent one
   of the same tenant copies those KV entries (:class:`~.prefix_cache.PrefixCache`); one of several
   choices of one prompt (a ``leader`` given) waits until the leader's prompt is in and copies its
   entries, so that the prompt is prefilled once for all choices;
2. **prefill** at most ``prefill_chunk`` prompt tokens, oldest request first, so that a long prompt
   delays the others by one chunk per step, not by its whole length; the chunks ride in the
   decoding step's forward (the weights are read once for both);
3. **decode**: one :func:`~speculum.engine.step` over every prefilled request, each with its own
   drafter (a fork of its method's), tree, guide and verifier; the tree sizer spends the rows of
   the forward where they buy the most tokens (:meth:`~speculum.tree_sizing.TreeSizer.select_batch`);
4. **retire** finished or cancelled requests and free their slots; others join on the next step.

Requests may use different engines (methods). Those whose engine runs on the batcher's runner
share its forwards; a request on another runner (a KV policy's :class:`~speculum.runners.PolicyRunner`
over the same model) takes a cache from that runner's own pool, is prefilled whole, and steps with
the others of its runner in a forward of their own (a policy's runner has no batched forward: it
runs them one after another).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache import SlotCache
from ..engine import Decoding, Engine, GenerationResult, step
from ..errors import SpeculumError
from ..result import FinishReason
from ..sampling import SamplingParams
from ..tree_sizing import TreeSizer
from .prefix_cache import PrefixCache, common_prefix


@dataclass
class BatchRequest:
    """One request for a :class:`Batcher`. ``on_tokens(ids)`` receives each committed chunk and
    ``on_done(result)`` the :class:`GenerationResult` (``on_error(exc)`` a failure), all called on
    the thread that runs :meth:`Batcher.step`."""

    engine: Engine
    prompt_ids: list[int]
    max_new_tokens: int = 128
    sampling: SamplingParams | None = None
    stop: Sequence[str] = ()
    seed: int | None = None
    grammar: object | None = None
    tenant: str = ""
    on_tokens: Callable[[list[int]], None] | None = None
    on_done: Callable[[GenerationResult], None] | None = None
    on_error: Callable[[Exception], None] | None = None
    decoding: Decoding | None = field(default=None, repr=False)
    reused: int = 0  # prompt tokens whose KV entries came from the prefix cache or the leader
    cancelled: bool = False
    # another choice of the same prompt, submitted before this one: its prompt's entries are copied
    leader: BatchRequest | None = field(default=None, repr=False)

    def chunk_logprobs(self, n: int) -> list | None:
        """The :class:`~speculum.result.TokenLogprob` s of the last ``n`` committed tokens (inside
        ``on_tokens``: its chunk's), or None where the request's sampling asks for none."""
        lps = self.decoding.logprobs if self.decoding is not None else None
        return None if lps is None else lps[len(lps) - n:]


class Batcher:
    """Runs :class:`BatchRequest` s together on one runner.

    Args:
        runner: the target's runner (every request's engine must use it).
        max_batch: the most requests decoded at once (KV slots).
        prefill_chunk: prompt tokens prefilled per step while others decode.
        prefix_cache: shared-prefix reuse (None: off).
        sizer: sizes the trees of a step together (default: the first engine's sizer seen).
        fused_prefill: prompt chunks ride in the decoding step's forward (False: a forward of their
            own before it).
    """

    def __init__(self, runner, max_batch: int = 8, prefill_chunk: int = 128,
                 prefix_cache: PrefixCache | None = None, sizer: TreeSizer | None = None,
                 fused_prefill: bool = True):
        if max_batch < 1:
            raise SpeculumError(f"max_batch must be at least 1, got {max_batch}")
        self.runner, self.max_batch, self.prefill_chunk = runner, max_batch, prefill_chunk
        self.pool = runner.new_pool(max_batch)
        self._pools = {runner: self.pool}  # runner -> its cache pool (side runners: KV policies')
        self.prefix_cache, self.sizer = prefix_cache, sizer
        self.fused_prefill = fused_prefill and runner.chunked_prefill
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []

    def resize(self, max_batch: int) -> None:
        """Decode up to ``max_batch`` requests at once from now on (while idle: a new slot pool)."""
        if not self.idle:
            raise RuntimeError("the batcher resizes only while idle")
        self.max_batch, self.pool = max_batch, self.runner.new_pool(max_batch)
        self._pools[self.runner] = self.pool

    def submit(self, request: BatchRequest) -> None:
        """Queue ``request``; it starts at a later :meth:`step` once a slot is free."""
        runner = request.engine.runner
        if runner is not self.runner and runner.inner is not self.runner:
            raise SpeculumError("a batched request must use the batcher's runner, or a KV policy's runner over it")
        self.waiting.append(request)

    def _pool(self, runner):
        """The cache pool of ``runner`` (the batcher's, or a side runner's, made on first use)."""
        pool = self._pools.get(runner)
        if pool is None:
            pool = self._pools[runner] = runner.new_pool(self.max_batch)
        return pool

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @torch.inference_mode()
    def step(self) -> None:
        """Admit, prefill up to ``prefill_chunk`` prompt tokens, decode one step for every prefilled
        request (in the same forward unless ``fused_prefill`` is off), retire."""
        self._admit()
        self._retire()
        for r in [r for r in self.running if r.engine.runner is not self.runner and not r.decoding.prefilled]:
            self._prefill_side(r)
        chunks = self._chunks()
        ready = [r for r in self.running if r.decoding.prefilled and r.decoding.reason is None]
        side = [r for r in ready if r.engine.runner is not self.runner]
        ready = [r for r in ready if r.engine.runner is self.runner]
        if not ready or not self.fused_prefill:
            for r, ids in chunks:  # prefill on its own
                self._prefill(r, ids)
            chunks = []
        if (ready or chunks) and not self._step(ready, chunks):
            self._retire()
            return
        for r, _ in chunks:
            self._prefilled(r)
        for runner in dict.fromkeys(r.engine.runner for r in side):
            self._step([r for r in side if r.engine.runner is runner])
        self._retire()

    def _step(self, requests: list[BatchRequest], chunks: list[tuple[BatchRequest, list[int]]] = ()) -> bool:
        """One :func:`~speculum.engine.step` over ``requests`` (and prompt ``chunks`` riding along),
        each request's new tokens delivered; False where the forward failed, failing the requests in it."""
        try:
            news = step([r.decoding for r in requests], self.sizer, [(r.decoding, ids) for r, ids in chunks])
        except Exception as e:  # noqa: BLE001 - a failed forward fails the requests in it, not the loop
            for r in requests + [r for r, _ in chunks]:
                self._fail(r, e)
            return False
        for r, new in zip(requests, news):
            if new and r.on_tokens is not None:
                r.on_tokens(new)
        return True

    def _prefill_side(self, r: BatchRequest) -> None:
        """Prefill a side runner's request whole, in a forward of its own (a KV policy builds its
        compressed cache from the whole prompt, layer by layer)."""
        try:
            r.decoding.prefill_some(r.decoding.to_prefill)
        except Exception as e:  # noqa: BLE001 - reported to that request alone
            self._fail(r, e)

    def _chunks(self) -> list[tuple[BatchRequest, list[int]]]:
        """This step's prompt chunks: at most ``prefill_chunk`` tokens in all, oldest request first.
        A request whose prompt is already all in its cache starts here."""
        budget, out = self.prefill_chunk, []
        for r in self.running:
            d = r.decoding
            if d.prefilled or d.reason is not None or r.engine.runner is not self.runner:
                continue
            if d.to_prefill == 0:
                d.chunk_done(0)
                continue
            if budget <= 0:
                break
            ids = d.next_chunk(budget)
            budget -= len(ids)
            out.append((r, ids))
        return out

    def run(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Submit ``requests``, step until all are done; their results in order (library use)."""
        results: dict[int, GenerationResult] = {}
        for i, r in enumerate(requests):
            prev = r.on_done
            r.on_done = (lambda res, i=i, prev=prev: (results.__setitem__(i, res), prev and prev(res)))
            self.submit(r)
        while not self.idle:
            self.step()
        return [results[i] for i in range(len(requests))]

    def _admit(self) -> None:
        deferred = []  # choices whose leader's prompt is not in yet
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting.popleft()
            if r.cancelled:
                continue
            entries, wait = self._leader_entries(r)
            if wait:
                deferred.append(r)
                continue
            pool = self._pool(r.engine.runner)
            cache = pool.acquire()
            try:
                # a drafter that reads hidden states needs the prompt's: a reused prefix has none
                if (entries is None and self.prefix_cache is not None and isinstance(cache, SlotCache)
                        and not r.engine.drafter.hidden_layers):
                    entries = self.prefix_cache.lookup(r.tenant, r.prompt_ids)
                if entries is not None:
                    cache.load(entries)
                    r.reused = entries.shape[3]
                drafter = r.engine.drafter.fork()
                r.decoding = r.engine.start(r.prompt_ids, r.max_new_tokens, r.sampling, r.stop, r.seed, r.grammar,
                                            cache=cache, drafter=drafter, prefill=False)
            except Exception as e:  # noqa: BLE001 - reported to that request alone
                pool.release(cache)
                self._fail(r, e, started=False)
                continue
            if self.sizer is None:
                self.sizer = r.engine.sizer
            self.running.append(r)
        self.waiting.extendleft(reversed(deferred))

    def _leader_entries(self, r: BatchRequest) -> tuple[torch.Tensor | None, bool]:
        """For a choice with a leader: ``(entries, wait)``, the leader's prompt entries
        ``[layers, 2, H_kv, m, d]`` to copy (None: prefill as usual), or ``wait`` while the leader's
        prompt is not yet all in its cache."""
        lead = r.leader
        # (a drafter that reads hidden states needs the prompt's, which copied entries lack)
        if (lead is None or lead.cancelled or lead.engine.runner is not r.engine.runner
                or r.engine.drafter.hidden_layers):
            return None, False
        d = lead.decoding
        if d is None or (d.reason is None and not d.prefilled):
            return None, True
        if d.reason is not None or not isinstance(d.cache, SlotCache):
            return None, False
        m = min(common_prefix(lead.prompt_ids, r.prompt_ids), len(r.prompt_ids) - 1, d.cache.length)
        return d.cache.kv[:, :, :, :m], False

    def _prefill(self, r: BatchRequest, ids: list[int]) -> None:
        """Commit ``ids``, the next chunk of ``r``'s prompt, in a forward of their own."""
        t = time.perf_counter()
        try:
            hidden = self.runner.prefill(r.decoding.cache, ids, r.decoding.drafter.hidden_layers)
        except Exception as e:  # noqa: BLE001 - reported to that request alone
            self._fail(r, e)
            return
        r.decoding.chunk_done(len(ids), time.perf_counter() - t, hidden)
        self._prefilled(r)

    def _prefilled(self, r: BatchRequest) -> None:
        """After a chunk: once the whole prompt is in, offer its entries to the prefix cache."""
        d = r.decoding
        if d.prefilled and self.prefix_cache is not None and isinstance(d.cache, SlotCache):
            n = d.cache.length
            if n > r.reused:
                self.prefix_cache.store(r.tenant, r.prompt_ids[:n], d.cache.kv[:, :, :, :n])

    def _fail(self, r: BatchRequest, e: Exception, started: bool = True) -> None:
        if started and r.decoding is not None:
            r.decoding.reason = r.decoding.reason or FinishReason.ERROR
        r.cancelled = True
        if r.on_error is not None:
            r.on_error(e)
        else:
            raise e

    def _retire(self) -> None:
        keep = []
        for r in self.running:
            d = r.decoding
            if r.cancelled and d.reason is None:
                d.cancel()
            if d.reason is None:
                keep.append(r)
                continue
            self._pool(r.engine.runner).release(d.cache)
            if d.reason != FinishReason.ERROR and not r.cancelled:
                result = d.finish()
                if r.on_done is not None:
                    r.on_done(result)
        self.running = keep
        in_use = {self.runner} | {r.engine.runner for r in keep + list(self.waiting)}
        for runner in [x for x in self._pools if x not in in_use]:  # a side runner's pool, now idle
            del self._pools[runner]
