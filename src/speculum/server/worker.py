"""One generation thread behind a bounded queue.

The model runs one request at a time on one thread (on a 2-core CPU a second concurrent forward
only slows both). HTTP handlers submit :class:`Job` s; the worker streams each job's tokens back
to the handler's event loop. A job whose client went away is cancelled between two decoding
steps; a queued one gives its queue slot back at once (:meth:`Worker.cancel`) and is skipped.
When ``max_queue`` jobs are already waiting, :meth:`submit` refuses the new one, and the server
answers 429.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..constrain import Grammar
from ..engine import GenerationResult
from ..errors import SpeculumError
from ..sampling import SamplingParams
from .metrics import Metrics

log = logging.getLogger("speculum.server")


@dataclass
class Job:
    """A request for the worker. ``events`` receives ``("tokens", [ids])``, then ``("done", result)``
    or ``("error", exception)`` or ``("cancelled", None)``."""

    method: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    seed: int | None
    grammar: Grammar | None
    loop: asyncio.AbstractEventLoop
    tenant: str = ""  # whose drafter state the job may use and teach (ServerState.get_method)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    queued: bool = False  # holds a queue slot (Worker.submit until dequeued or cancelled)

    def emit(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class QueueFull(Exception):
    """Raised by :meth:`Worker.submit`; ``retry_after_s`` is an estimate of when a slot frees."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Worker:
    """Runs jobs one at a time on the methods ``get_method(name, tenant)`` returns
    (:class:`~speculum.methods.EngineMethod`, built on demand)."""

    def __init__(self, get_method, metrics: Metrics, max_queue: int = 16):
        self.get_method, self.metrics, self.max_queue = get_method, metrics, max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._mean_request_s = 1.0  # running mean of a request's service time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="speculum-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(f"the server is busy: {self._waiting} requests are already waiting "
                                f"(--max-queue {self.max_queue}); retry later",
                                max(1, round(self._waiting * self._mean_request_s)))
            self._waiting += 1
            job.queued = True
            self.metrics.waiting.set(self._waiting)
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
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._release(job)
            if job.cancelled.is_set():
                self.metrics.cancelled.inc()
                job.emit("cancelled", None)
                continue
            self.metrics.running.set(1)
            try:
                self._generate(job)
            except SpeculumError as e:
                job.emit("error", e)
            except Exception as e:  # a bug must not kill the worker thread
                log.exception("generation failed")
                job.emit("error", e)
            finally:
                self.metrics.running.set(0)

    def _generate(self, job: Job) -> None:
        job.started = time.perf_counter()
        method = self.get_method(job.method, job.tenant)
        it = method.engine.stream(job.prompt_ids, job.max_tokens, job.sampling, job.stop, job.seed, job.grammar)
        try:
            while True:
                if job.cancelled.is_set():
                    self.metrics.cancelled.inc()
                    job.emit("cancelled", None)
                    return
                try:
                    chunk = next(it)
                except StopIteration as done:
                    result: GenerationResult = done.value
                    break
                if job.first_token is None:
                    job.first_token = time.perf_counter()
                job.emit("tokens", chunk)
        finally:
            it.close()
        end = time.perf_counter()
        ttft = job.first_token - job.submitted if job.first_token is not None else None
        self.metrics.record(job.method, result, ttft, job.started - job.submitted, end - job.submitted)
        self._mean_request_s = 0.8 * self._mean_request_s + 0.2 * (end - job.started)
        job.emit("done", result)
