"""Engine processes: the model served by ``N`` processes, each with its own copy of the weights, its
own :class:`~speculum.batching.Batcher` and (by default) one kernel thread, behind the HTTP
process (data parallelism on one machine, as vLLM's ``--data-parallel-size``).

Why, on a CPU: a forward's kernels spread over several threads stall whenever another process
takes one of their cores (each parallel region waits for its slowest thread), and the HTTP side
and the clients always take some; an engine on one thread loses only the CPU time taken from it.
BENCHMARKS.md ("Serving: engine processes") has the measurements.

Requests are dispatched when an engine has a free batch slot, to the engine running the fewest
(on a tie, the one that served the request's tenant last, whose drafters and prefix cache know
it); the others wait here, in one bounded queue. Drafter state and the prefix cache are per engine.

Messages over each engine's pipe (pickled):

- to the engine: ``("submit", jid, EngineJob)``, ``("cancel", jid)``, ``("close",)``;
- from it: ``("ready", info)`` or ``("fatal", text)`` once, then ``(jid, "tokens", (ids, logprobs))``,
  ``(jid, "done", (result, reused_prompt_tokens))``, ``(jid, "error", exception)``, and once
  ``(None, "calibrated", max_batch)`` when its background calibration is done.

Engine 0 measures the calibration in its idle moments if it is not on disk; the others read it
from disk once it is there (:class:`~speculum.calibrate.BackgroundCalibration`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ..errors import SpeculumError
from .metrics import Metrics
from .worker import Generation, Job, JobAccounting

log = logging.getLogger("speculum.server")
STARTUP_S = 900.0  # an engine's model load and first calibration
MAX_TENANTS = 4096  # tenants whose last engine is remembered (each request's tenant is client-chosen)


@dataclass(frozen=True)
class EngineConfig:
    """What each engine process loads and how it serves (the ``serve`` options it needs)."""

    model: str = "default"
    dtype: str | None = None
    device: str | None = None
    runner: str = "auto"
    threads: int = 1
    method: str = "auto"
    max_tree: int = 64
    deterministic: bool | None = None
    max_batch: int | None = None
    prefix_cache_mb: int = 256
    draft_head: tuple[str, ...] | None = None  # head files (--draft-head), any kinds
    weights: str | None = None  # --weights (None: auto)
    calibrate: bool = True  # measure the cost curve here if it is not on disk (else wait for it there)


@dataclass
class EngineJob(Generation):
    """A :class:`~.worker.Job` as an engine receives it: the constraint travels as its spec and is
    compiled again there (from that process's cache)."""

    constraint: tuple | None  # (ConstraintSpec, close_reserve)
    tenant: str
    kv: tuple[str, str] | None = None  # (KV policy, budget)
    leader: int | None = None  # the job id of choice 0 of the same request, on this engine


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - any exception must reach the client as text at least
        return RuntimeError(f"{type(e).__name__}: {e}")


def _engine_main(conn, config: EngineConfig) -> None:  # pragma: no cover - runs in the engine process
    """An engine process: load, report ``ready``, then decode what arrives, one batched step at a time."""
    import torch

    torch.set_num_threads(config.threads)
    try:
        from ..constrain import compile_constraint
        from ..loading import load
        from ..runners import release_if_native, use_runner
        from .model_state import ModelState

        model, tok = load(config.model, config.dtype, config.device, weights=config.weights)
        use_runner(model, config.runner)
        release_if_native(model)
        state = ModelState(model, tok, config.method, max_tree=config.max_tree, deterministic=config.deterministic,
                           max_batch=config.max_batch, prefix_cache_mb=config.prefix_cache_mb,
                           draft_head=config.draft_head, calibrate=config.calibrate)
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
        weights += sum(q.nbytes for q in getattr(model, "speculum_quant", {}).values())
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, which refuses to start
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", {**state.info(), "weight_bytes": weights}))

    from ..batching import BatchRequest

    batcher, live = state.batcher, {}

    def start(jid: int, job: EngineJob) -> None:
        try:
            method = state.get_method(job.method, job.tenant, job.kv)
            grammar = None
            if job.constraint is not None:
                spec, reserve = job.constraint
                grammar = compile_constraint(spec, tok, state.runner.vocab_size, state.eos_ids, reserve)
        except Exception as e:  # noqa: BLE001 - that request's error
            conn.send((jid, "error", _picklable(e)))
            return

        def done(result) -> None:
            request = live.pop(jid)
            conn.send((jid, "done", (result, request.reused)))

        def failed(e: Exception) -> None:
            live.pop(jid, None)
            conn.send((jid, "error", _picklable(e)))

        live[jid] = BatchRequest(method.engine, job.prompt_ids, job.max_tokens, job.sampling, job.stop, job.seed,
                                 grammar, job.tenant,
                                 lambda ids: conn.send((jid, "tokens", (ids, live[jid].chunk_logprobs(len(ids))))),
                                 done, failed, leader=live.get(job.leader))
        batcher.submit(live[jid])

    calibrated = state.calibration.done
    try:
        while True:
            wait = state.idle_timeout() if batcher.idle else 0
            if not conn.poll(wait) and batcher.idle:
                state.idle_step()
                if state.calibration.done and not calibrated:
                    calibrated = True
                    conn.send((None, "calibrated", state.batch_after_calibration))
                continue
            while conn.poll(None if batcher.idle else 0):
                msg = conn.recv()
                if msg[0] == "close":
                    return
                if msg[0] == "cancel":
                    request = live.pop(msg[1], None)
                    if request is not None:
                        request.cancelled = True
                elif msg[0] == "submit":
                    start(msg[1], msg[2])
            if batcher.idle:
                continue
            try:
                batcher.step()
            except Exception as e:
                log.exception("generation failed")
                for jid, request in list(live.items()):
                    request.cancelled = True
                    conn.send((jid, "error", _picklable(e)))
                live.clear()
                batcher.step()  # retire the failed requests (frees their slots)
    except (EOFError, OSError, KeyboardInterrupt):
        return  # the HTTP process went away


@dataclass
class _Engine:
    index: int
    process: mp.Process
    conn: object
    jobs: dict[int, Job] = field(default_factory=dict)
    alive: bool = True


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class EnginePool(JobAccounting):
    """``engines`` engine processes behind one bounded queue; the :class:`~.worker.Worker` interface
    (:meth:`submit`, :meth:`cancel`, :meth:`close`, ``max_batch``) for the HTTP app.

    Engines start one after another (the first may calibrate; the others find its results). An
    engine is started only while the machine's available memory holds another copy of the weights
    with room to spare; ``engines`` lists those that run, ``skipped`` says why others did not."""

    def __init__(self, config: EngineConfig, engines: int, metrics: Metrics, max_queue: int = 16):
        if engines < 1:
            raise SpeculumError(f"engines must be at least 1, got {engines}")
        self.config, self.metrics, self.max_queue = config, metrics, max_queue
        self._lock = threading.RLock()
        self._waiting: deque[Job] = deque()
        self._ids = itertools.count()
        self._last_engine: OrderedDict[str, int] = OrderedDict()  # tenant -> engine (the latest MAX_TENANTS)
        self.engines: list[_Engine] = []
        self.info: dict = {}
        self.skipped: str | None = None
        ctx = mp.get_context("spawn")  # never fork a process that holds torch's thread pools
        for i in range(engines):
            if i > 0:
                free = _available_memory()
                if free is not None and free < 2 * self.info["weight_bytes"]:
                    self.skipped = (f"started {i} of {engines} engines: {free >> 20} MiB of memory available, "
                                    f"each engine holds {self.info['weight_bytes'] >> 20} MiB of weights")
                    break
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_engine_main, args=(child, dataclasses.replace(config, calibrate=i == 0)),
                                  name=f"speculum-engine-{i}", daemon=True)
            process.start()
            child.close()
            if not parent.poll(STARTUP_S):
                process.kill()
                self.close()
                raise SpeculumError(f"engine {i} did not start within {STARTUP_S:g} s")
            try:
                msg = parent.recv()
            except EOFError:
                msg = ("fatal", f"the process exited with code {process.join(5) or process.exitcode}")
            if msg[0] != "ready":
                self.close()
                raise SpeculumError(f"engine {i} failed to start: {msg[1]}")
            self.info = self.info or msg[1]
            self.engines.append(_Engine(i, process, parent))
        self.max_batch = self.info["max_batch"]
        self.calibrated = self.info["calibrated"]
        self._running = metrics.running
        self.per_engine = metrics.engine_requests
        for e in self.engines:
            threading.Thread(target=self._read, args=(e,), name=f"speculum-engine-{e.index}-reader",
                             daemon=True).start()

    # -- the Worker interface --------------------------------------------------------------------

    def submit(self, *jobs: Job) -> None:
        """Queue ``jobs`` (the choices of one request), all or none."""
        with self._lock:
            if not any(e.alive for e in self.engines):
                raise SpeculumError("no engine is running (see the server log)")
            free = sum(self.max_batch - len(e.jobs) for e in self.engines if e.alive)
            if len(self._waiting) + len(jobs) > self.max_queue + max(free, 0):
                raise self._queue_full(len(self._waiting), self.max_batch * len(self.engines))
            for job in jobs:
                job.queued = True
                self._waiting.append(job)
            self._dispatch()

    def cancel(self, job: Job) -> None:
        with self._lock:
            job.cancelled.set()
            if job.queued:
                job.queued = False
                self._waiting.remove(job)
                self.metrics.waiting.set(len(self._waiting))
                return
            for e in self.engines:
                for jid, j in list(e.jobs.items()):
                    if j is job:
                        del e.jobs[jid]
                        self._send(e, ("cancel", jid))
                        self.metrics.cancelled.inc()
                        job.emit("cancelled", None)
                        self._dispatch()
                        return

    def close(self) -> None:
        for e in self.engines:
            try:
                e.conn.send(("close",))
            except (OSError, ValueError):
                pass
        for e in self.engines:
            e.process.join(timeout=10)
            if e.process.is_alive():
                e.process.kill()

    # -- inside ------------------------------------------------------------------------------------

    def _send(self, e: _Engine, msg: tuple) -> None:
        try:
            e.conn.send(msg)
        except (OSError, ValueError) as exc:  # the engine died: its reader fails its jobs
            log.error("engine %d: %s", e.index, exc)

    def _dispatch(self) -> None:
        """Start waiting jobs on engines with a free slot (under the lock)."""
        while self._waiting:
            open_ = [e for e in self.engines if e.alive and len(e.jobs) < self.max_batch]
            if not open_:
                break
            job = self._waiting.popleft()
            job.queued = False
            least = min(len(e.jobs) for e in open_)
            last = self._last_engine.get(job.tenant)
            e = next((e for e in open_ if e.index == last and len(e.jobs) == least),
                     next(e for e in open_ if len(e.jobs) == least))
            leader = None  # a later choice goes where choice 0 runs, to copy its prompt's entries
            for other in open_:
                leader = next((jid for jid, j in other.jobs.items() if j is job.leader), None)
                if leader is not None:
                    e = other
                    break
            jid = next(self._ids)
            e.jobs[jid] = job
            self._last_engine[job.tenant] = e.index
            self._last_engine.move_to_end(job.tenant)
            if len(self._last_engine) > MAX_TENANTS:
                self._last_engine.popitem(last=False)
            job.started = time.perf_counter()
            g = job.grammar
            self._send(e, ("submit", jid, EngineJob(job.method, job.prompt_ids, job.max_tokens, job.sampling, job.stop,
                                                    job.seed, None if g is None else (g.spec, g.close_reserve),
                                                    job.tenant, job.kv, leader)))
            self.per_engine.labels(str(e.index)).inc()
        self.metrics.waiting.set(len(self._waiting))
        self._running.set(sum(len(e.jobs) for e in self.engines))

    def _read(self, e: _Engine) -> None:
        """Deliver engine ``e``'s events to their jobs' clients."""
        while True:
            try:
                jid, kind, value = e.conn.recv()
            except (EOFError, OSError):
                with self._lock:
                    e.alive = False
                    lost = list(e.jobs.values())
                    e.jobs.clear()
                    self._dispatch()
                if lost:
                    log.error("engine %d exited with %d requests running", e.index, len(lost))
                for job in lost:
                    job.emit("error", RuntimeError(f"engine {e.index} exited"))
                return
            if jid is None:  # engine 0's calibration is done (the batch it picks, for every engine)
                log.info("calibration done: draft trees are sized from now on, up to %d requests per forward", value)
                with self._lock:
                    self.calibrated, self.max_batch = True, value
                    self._dispatch()
                continue
            with self._lock:
                job = e.jobs.get(jid)
                if job is None:  # cancelled meanwhile
                    continue
                if kind == "tokens":
                    self._tokens(job, value)
                    continue
                del e.jobs[jid]
                if kind == "done":
                    self._finished(job, *value)
                else:
                    job.emit("error", value)
                self._dispatch()


def default_engines(device: str | None) -> int:
    """Engine processes ``serve`` starts by default: two on a CPU with at least two cores (one kernel
    thread each on two cores), else one."""
    from ..models import default_device

    if (device or default_device()) != "cpu":
        return 1
    return 2 if (os.cpu_count() or 1) >= 2 else 1
