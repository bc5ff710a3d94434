"""One generation thread behind a bounded queue, decoding up to ``max_batch`` requests at once.

The model runs on one thread (on a 2-core CPU two concurrent forwards only slow each other); that
thread runs a :class:`~speculum.batching.Batcher`, which decodes every running request in one
forward per step (continuous batching: requests join and leave between steps). HTTP handlers
submit :class:`Job` s; the worker streams each job's tokens back to the handler's event loop. A
job whose client went away is cancelled between two steps; a queued one gives its queue slot back
at once (:meth:`Worker.cancel`) and is skipped. Jobs wait in the queue while ``max_batch`` are
running; when ``max_queue`` are already waiting, :meth:`submit` refuses the new one, and the
server answers 429.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..batching import Batcher, BatchRequest
from ..constrain import Grammar
from ..engine import GenerationResult
from ..errors import SpeculumError
from ..sampling import SamplingParams
from .metrics import Metrics

log = logging.getLogger("speculum.server")


@dataclass
class Generation:
    """What to generate: the fields a job and an engine process's copy of it share."""

    method: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    seed: int | None


@dataclass
class Job(Generation):
    """A request for the worker: one choice of a completion. ``events`` receives ``(index,
    "tokens", ([ids], [TokenLogprob] or None))``, then ``(index, "done", result)`` or ``(index,
    "error", exception)`` or ``(index, "cancelled", None)``; the choices of one request share it."""

    grammar: Grammar | None
    loop: asyncio.AbstractEventLoop
    tenant: str = ""  # whose drafter state the job may use and teach (ServerState.get_method)
    kv: tuple[str, str] | None = None  # (KV policy, budget) for this request, or the full cache
    index: int = 0  # which choice of its request
    leader: Job | None = field(default=None, repr=False)  # choice 0 of the request, whose prompt entries are copied
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    queued: bool = False  # holds a queue slot (Worker.submit until dequeued or cancelled)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value))

    def choices(self, n: int) -> list[Job]:
        """This job and ``n - 1`` more choices of the same request (sharing its events): choice ``i``
        samples with ``seed + i`` (so that a seeded request repeats), and copies the prompt's entries
        from this one (``seed + i`` past ``2**64 - 1``, the largest seed, wraps to 0)."""

        def seed(i: int) -> int | None:
            if self.seed is None:
                return None
            return self.seed + i - (1 << 64 if self.seed + i >= 1 << 64 else 0)

        return [self] + [dataclasses.replace(self, index=i, seed=seed(i), leader=self, events=self.events,
                                             cancelled=threading.Event(), submitted=time.perf_counter())
                         for i in range(1, n)]


class QueueFull(Exception):
    """Raised by :meth:`Worker.submit`; ``retry_after_s`` is an estimate of when a slot frees."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JobAccounting:
    """What the in-process :class:`Worker` and the engine processes' pool
    (:class:`~.engines.EnginePool`) share: a job's tokens and result delivered to its client with
    their metrics, and the Retry-After estimate of a refusal."""

    metrics: Metrics
    max_queue: int
    _mean_request_s = 1.0  # running mean of a request's service time, for Retry-After

    def _queue_full(self, waiting: int, slots: int) -> QueueFull:
        """The refusal while ``waiting`` jobs wait for ``slots`` batch slots."""
        return QueueFull(f"the server is busy: {waiting} requests are already waiting (--max-queue {self.max_queue}); "
                         "retry later", max(1, round(waiting * self._mean_request_s / slots)))

    @staticmethod
    def _tokens(job: Job, chunk: tuple) -> None:
        """``chunk``: a committed chunk's ``(ids, their logprobs or None)``."""
        if job.first_token is None:
            job.first_token = time.perf_counter()
        job.emit("tokens", chunk)

    def _finished(self, job: Job, result: GenerationResult, reused: int) -> None:
        """``job`` is done (``reused`` prompt tokens came from the prefix cache): record, deliver."""
        end = time.perf_counter()
        ttft = job.first_token - job.submitted if job.first_token is not None else None
        self.metrics.record(job.method, result, ttft, job.started - job.submitted, end - job.submitted)
        self.metrics.prefix_hit_tokens.inc(reused)
        self.metrics.prefill_tokens.inc(result.prompt_tokens - reused)
        self._mean_request_s = 0.8 * self._mean_request_s + 0.2 * (end - job.started)
        job.emit("done", result)


class Worker(JobAccounting):
    """Runs jobs on the methods ``get_method(name, tenant)`` returns
    (:class:`~speculum.methods.EngineMethod`, built on demand), through ``batcher``; while none
    runs, ``idle`` (a :class:`~.model_state.ModelState`) gets the thread for its background work."""

    def __init__(self, get_method, metrics: Metrics, batcher: Batcher, max_queue: int = 16, idle=None):
        self.get_method, self.metrics, self.max_queue = get_method, metrics, max_queue
        self.batcher, self.idle = batcher, idle
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._thread = threading.Thread(target=self._run, name="speculum-worker", daemon=True)
        self._thread.start()

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (the choices of one request), all or none."""
        with self._lock:
            if self._waiting + len(jobs) > self.max_queue:
                raise self._queue_full(self._waiting, self.batcher.max_batch)
            self._waiting += len(jobs)
            for job in jobs:
                job.queued = True
            self.metrics.waiting.set(self._waiting)
        for job in jobs:
            self._queue.put(job)

    def cancel(self, job: Job) -> None:
        """Stop ``job``: a running one between two decoding steps, a queued one at once (its slot
        is free for the next request as this returns)."""
        with self._lock:
            job.cancelled.set()
            self._release(job)

    def _release(self, job: Job) -> None:
        if job.queued:  # under self._lock
            job.queued = False
            self._waiting -= 1
            self.metrics.waiting.set(self._waiting)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        b = self.batcher
        running: dict[int, tuple[Job, BatchRequest]] = {}
        while True:
            # take jobs while a slot is free; block only when nothing runs
            while len(running) < b.max_batch and not (running and self._queue.empty()):
                wait = None if running or self.idle is None else self.idle.idle_timeout()
                try:
                    job = self._queue.get(block=not running and wait != 0, timeout=wait)
                except queue.Empty:
                    if not running and self.idle is not None:
                        self.idle.idle_step()
                    break
                if job is None:
                    return
                with self._lock:
                    self._release(job)
                if job.cancelled.is_set():
                    self.metrics.cancelled.inc()
                    job.emit("cancelled", None)
                    continue
                req = self._request(job, running)
                if req is not None:
                    running[id(job)] = (job, req)
                    b.submit(req)
            for job, req in list(running.values()):
                if job.cancelled.is_set() and not req.cancelled:
                    req.cancelled = True
                    running.pop(id(job))
                    self.metrics.cancelled.inc()
                    job.emit("cancelled", None)
            if running:
                try:
                    b.step()
                except Exception as e:
                    log.exception("generation failed")
                    for job, req in running.values():
                        req.cancelled = True
                        job.emit("error", e)
                    running.clear()
                    b.step()  # retire the failed requests (frees their slots)
            self.metrics.running.set(len(b.running))

    def _request(self, job: Job, running: dict) -> BatchRequest | None:
        """The batcher's request for ``job``, its callbacks streaming to the job's client."""
        try:
            method = self.get_method(job.method, job.tenant, job.kv)
        except SpeculumError as e:
            job.emit("error", e)
            return None
        job.started = time.perf_counter()

        def on_done(result: GenerationResult) -> None:
            running.pop(id(job), None)
            self._finished(job, result, request.reused)

        def on_error(e: Exception) -> None:
            running.pop(id(job), None)
            if not isinstance(e, SpeculumError):
                log.error("generation failed", exc_info=e)
            job.emit("error", e)

        request = BatchRequest(method.engine, job.prompt_ids, job.max_tokens, job.sampling, job.stop, job.seed,
                               job.grammar, job.tenant,
                               lambda ids: self._tokens(job, (ids, request.chunk_logprobs(len(ids)))), on_done, on_error)
        if job.leader is not None:
            request.leader = running.get(id(job.leader), (None, None))[1]
        return request
