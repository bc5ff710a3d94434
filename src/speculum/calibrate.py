"""Measure what a verification forward costs on this machine, once, and keep it on disk.

:func:`measure` times :meth:`Runner.forward_tree` over ``n`` tree tokens (``n`` in
:data:`TOKEN_COUNTS`) after ``L`` cached tokens (``L`` in :data:`CONTEXTS`, those that fit), each
the median of several interleaved repetitions after a warm-up. The result, a
:class:`~speculum.tree_sizing.CostModel`, is cached by :func:`load_or_measure` as JSON under
``$SPECULUM_CACHE/calibration/`` keyed by the model's configuration, dtype, device, thread count
and library versions, so it is measured once per model x dtype x device (and remembered in this
process by the same key). ``speculum calibrate`` runs it from the command line and
:func:`write_report` renders the curves: a Markdown table, JSON and a plot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Generator
from pathlib import Path

import torch
from tqdm import tqdm

from .figures import save, subplots
from .models import cache_dir, write_atomic
from .tree import DraftTree
from .tree_sizing import CostModel, best_size
from .verify import greedy_tokens

TOKEN_COUNTS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
CONTEXTS = [64, 512, 2048]
BATCH_SIZES = [1, 2, 4, 8, 16]  # sequences in one batched forward
BATCH_ROWS = [1, 2, 4, 8]  # rows per sequence in it
BATCH_CONTEXT = 256  # cached entries per sequence while the batch is timed
REPEATS = 5
FORMAT = 4  # bump when what is measured or how forwards run changes (4: float32 linears prepacked), so that stale cached curves are not reused

# a reference acceptance profile for reporting the budget a cost curve implies: the scores of a
# tree whose best nodes are accepted with probability 0.8, 0.7, ... decaying geometrically
REFERENCE_SCORES = [0.8 * 0.93 ** i for i in range(64)]


def _machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def calibration_key(runner) -> str:
    """A hash of everything the forward cost depends on."""
    import transformers

    cfg = runner.config.to_json_string(use_diff=False)
    parts = [str(FORMAT), cfg, str(runner.dtype), str(runner.device), _machine(), torch.__version__,
             transformers.__version__, os.environ.get("SPECULUM_PACKED_LINEAR", "1"), type(runner).__name__,
             runner.variant]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _tree(n: int, vocab: int, rng: random.Random) -> DraftTree:
    """``n - 1`` drafted nodes in a binary-heap shape (the root counts as the first token)."""
    k = n - 1
    return DraftTree([rng.randrange(vocab) for _ in range(k)], [(i - 1) // 2 for i in range(k)])


def measure(runner, token_counts=TOKEN_COUNTS, contexts=None, repeats: int = REPEATS,
            progress: bool = False) -> CostModel:
    """Time ``runner.forward_tree`` over each token count at each context length (and, where the
    runner batches, its batched forward: :func:`measure_steps`)."""
    steps = measure_steps(runner, token_counts, contexts, repeats, progress)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def measure_steps(runner, token_counts=TOKEN_COUNTS, contexts=None, repeats: int = REPEATS,
                  progress: bool = False) -> Generator[None, None, CostModel]:
    """:func:`measure` one forward at a time: yields after each timed forward (a server measures in
    its idle moments) and returns the :class:`CostModel`."""
    limit = runner.max_positions - max(token_counts) - 1
    contexts = [c for c in (contexts or CONTEXTS) if c <= limit] or [max(1, min(64, limit))]
    rng = random.Random(0)
    vocab = min(runner.vocab_size, 32000)
    bar = tqdm(total=len(contexts) * (repeats + 1) * len(token_counts), desc="calibrating", unit="fwd",
               disable=not progress)
    seconds = []
    for ctx in contexts:
        cache = runner.new_cache(ctx + max(token_counts) + 1)
        runner.prefill(cache, [rng.randrange(vocab) for _ in range(ctx)])
        times: dict[int, list[float]] = {n: [] for n in token_counts}
        for rep in range(repeats + 1):  # repetition 0 is the warm-up
            for n in token_counts:
                tree = _tree(n, vocab, rng)
                t0 = time.perf_counter()
                logits = runner.forward_tree(cache, rng.randrange(vocab), tree)
                greedy_tokens(logits)  # the verifier's first step; synchronises a GPU
                if rep:
                    times[n].append(time.perf_counter() - t0)
                cache.pending = 0
                bar.update()
                yield
        seconds.append([statistics.median(times[n]) for n in token_counts])
    bar.close()
    cost = CostModel(list(token_counts), contexts, seconds)
    if runner.batched_forward:
        cost.sequences, cost.rows, cost.batch_context = list(BATCH_SIZES), list(BATCH_ROWS), BATCH_CONTEXT
        cost.batch_seconds = yield from _measure_batches(runner, rng, vocab, repeats, progress)
    return cost


def _measure_batches(runner, rng: random.Random, vocab: int, repeats: int = REPEATS,
                     progress: bool = False) -> Generator[None, None, list[list[float]]]:
    """``[len(BATCH_SIZES)][len(BATCH_ROWS)]`` median seconds of one batched forward over ``B``
    sequences of ``BATCH_CONTEXT`` cached entries each, every one with a chain of ``r`` rows
    (yields after each forward)."""
    ctx = min(BATCH_CONTEXT, runner.max_positions - max(BATCH_ROWS) - 1)
    pool = runner.new_pool(max(BATCH_SIZES), ctx + max(BATCH_ROWS) + 1)
    caches = [pool.acquire() for _ in range(max(BATCH_SIZES))]
    for c in caches:
        runner.prefill(c, [rng.randrange(vocab) for _ in range(ctx)])
    times = {(b, r): [] for b in BATCH_SIZES for r in BATCH_ROWS}
    bar = tqdm(total=len(times) * (repeats + 1), desc="calibrating batches", unit="fwd", disable=not progress)
    for rep in range(repeats + 1):  # repetition 0 is the warm-up
        for (b, r), spent in times.items():
            trees = [DraftTree.chain([rng.randrange(vocab) for _ in range(r - 1)]) for _ in range(b)]
            roots = [rng.randrange(vocab) for _ in range(b)]
            t0 = time.perf_counter()
            out = runner.forward_batch(caches[:b], roots, trees)
            greedy_tokens(out[-1].logits)
            if rep:
                spent.append(time.perf_counter() - t0)
            for c in caches[:b]:
                c.pending = 0
            bar.update()
            yield
    bar.close()
    for c in caches:
        pool.release(c)
    return [[statistics.median(times[b, r]) for r in BATCH_ROWS] for b in BATCH_SIZES]


def default_max_batch(cost: CostModel, slowdown: float = 3.0, limit: int = 16) -> int:
    """The most sequences (up to ``limit``) one forward may serve while a step costs at most
    ``slowdown`` times a single sequence's: throughput grows with the batch, and this bounds what
    each user's tokens cost in latency. 1 where the batched forward was not measured."""
    if not cost.sequences:
        return 1
    one = cost.batch_cost(1, 1, cost.batch_context)
    fits = [b for b in cost.sequences
            if b <= limit and cost.batch_cost(b, b, b * cost.batch_context) <= slowdown * one]
    return max(fits, default=1)


def _path(key: str):
    return cache_dir() / "calibration" / f"{key}.json"


_MEASURED: dict[str, CostModel] = {}  # calibration key -> cost model, for this process
_PENDING: dict[str, BackgroundCalibration] = {}  # keys a server measures (or waits for) in the background
LOOK_EVERY_S = 5.0  # how often a server that waits for another process's calibration looks for it
log = logging.getLogger("speculum.server")


def _key(runner, contexts: list[int]) -> str:
    return calibration_key(runner) + ("" if contexts == CONTEXTS else "-" + "-".join(map(str, contexts)))


def cached(runner, contexts: list[int] | None = None) -> CostModel | None:
    """The runner's cost model from memory or disk, or None (never measures)."""
    contexts = list(contexts or CONTEXTS)
    key = _key(runner, contexts)
    if key not in _MEASURED and key not in _PENDING:
        try:
            _MEASURED[key] = CostModel.from_dict(json.loads(_path(key).read_text())["cost"])
        except (OSError, ValueError, KeyError):
            return None
    return _MEASURED.get(key)


def _save(runner, key: str, cost: CostModel) -> None:
    meta = {"model": getattr(runner.config, "_name_or_path", ""), "dtype": str(runner.dtype),
            "device": str(runner.device), "machine": _machine(), "cost": cost.to_dict()}
    write_atomic(_path(key), json.dumps(meta, indent=1))
    _MEASURED[key] = cost


def load_or_measure(runner, progress: bool = False, force: bool = False,
                    announce: Callable[[], None] | None = None, contexts: list[int] | None = None) -> CostModel | None:
    """The runner's cost model: from memory, from disk, or measured now (and saved); ``announce`` is
    called before a measurement starts (to tell the user why the run pauses). ``contexts``: context
    lengths to time (default :data:`CONTEXTS`, the curve the tree sizer reads; others are kept apart).
    None while a :class:`BackgroundCalibration` of this process measures it."""
    contexts = list(contexts or CONTEXTS)
    key = _key(runner, contexts)
    if key in _PENDING and not force:
        return _PENDING[key].poll()
    cost = None if force else cached(runner, contexts)
    if cost is None:
        if announce is not None:
            announce()
        cost = measure(runner, contexts=contexts, progress=progress)
        _save(runner, key, cost)
    return cost


class BackgroundCalibration:
    """A server's calibration: the runner's cost model measured one forward at a time in the idle
    moments of the thread that runs the model (:meth:`step`, so that it never runs beside a request's
    forward), or (``measure=False``: another process measures it) read from disk once it is there.
    Until then :func:`load_or_measure` gives None for this runner (the tree sizer then sizes trees
    by :data:`~speculum.tree_sizing.PROVISIONAL`, a cautious stand-in)."""

    def __init__(self, runner, measure: bool = True, on_done: Callable[[CostModel], None] | None = None):
        self.runner, self.on_done = runner, on_done
        self.key = _key(runner, CONTEXTS)
        self.cost = cached(runner)
        measure = measure and self.key not in _PENDING  # (not twice in one process)
        self.steps = measure_steps(runner) if measure and self.cost is None else None
        self._looked = 0.0
        if self.cost is None:
            _PENDING.setdefault(self.key, self)

    @property
    def done(self) -> bool:
        return self.cost is not None

    @property
    def measuring(self) -> bool:
        """Measured here (else looked for on disk)."""
        return self.steps is not None

    def poll(self) -> CostModel | None:
        """The cost model once measured (here or, at most every few seconds, looked for on disk)."""
        if self.cost is None and self.steps is None and time.monotonic() - self._looked > LOOK_EVERY_S:
            self._looked = time.monotonic()
            mine = _PENDING.get(self.key) is self
            if mine:
                del _PENDING[self.key]
            cost = cached(self.runner)
            if cost is not None:
                self._finish(cost)
            elif mine:
                _PENDING[self.key] = self
        return self.cost

    def close(self) -> None:
        """Stop (the server closes): this process measures it on demand again."""
        self.steps = None
        if _PENDING.get(self.key) is self:
            del _PENDING[self.key]

    def step(self) -> None:
        """One forward of the measurement (call when the model is idle); saves the result after the last."""
        if self.steps is None:
            self.poll()
            return
        try:
            next(self.steps)
        except StopIteration as finished:
            self.steps = None
            _save(self.runner, self.key, finished.value)
            self._finish(finished.value)

    def _finish(self, cost: CostModel) -> None:
        self.cost = cost
        if _PENDING.get(self.key) is self:
            del _PENDING[self.key]
        log.info("calibration done: this machine's forward costs are measured; draft trees are sized from now on")
        if self.on_done is not None:
            self.on_done(cost)


def report_text(curves: dict[str, CostModel]) -> str:
    """A Markdown table per curve (label, e.g. a dtype -> cost model): forward time by context and token
    count, and the tree budget it implies for :data:`REFERENCE_SCORES`."""
    lines = []
    for label, cost in curves.items():
        lines += [f"{label}: forward time in ms (rows: context length; columns: tokens in the forward)", "",
                  "| context | " + " | ".join(str(n) for n in cost.tokens) + " | tree budget |",
                  "|---:|" + "---:|" * (len(cost.tokens) + 1)]
        for ctx, row in zip(cost.contexts, cost.seconds):
            lines.append(f"| {ctx} | " + " | ".join(f"{1000 * s:.1f}" for s in row)
                         + f" | {best_size(REFERENCE_SCORES, cost, ctx)} |")
        lines.append("")
        if cost.sequences:
            lines += [(f"{label}: batched forward time in ms, {cost.batch_context} cached entries per sequence "
                       f"(rows: sequences; columns: rows per sequence); default --max-batch "
                       f"{default_max_batch(cost)}"), "",
                      "| sequences | " + " | ".join(str(r) for r in cost.rows) + " |",
                      "|---:|" + "---:|" * len(cost.rows)]
            for b, row in zip(cost.sequences, cost.batch_seconds):
                lines.append(f"| {b} | " + " | ".join(f"{1000 * x:.1f}" for x in row) + " |")
            lines.append("")
    lines.append("tree budget: nodes kept for a reference tree whose i-th best node is accepted with "
                 "probability 0.8 * 0.93^i (the sizer uses each drafter's learnt scores instead).")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, curves: dict[str, CostModel], runners: dict[str, str]) -> tuple[str, Path]:
    """Write ``calibration.json``, ``calibration.md`` and ``calibration.png`` into ``out_dir``;
    ``runners``: label -> runner kind. Returns the Markdown text and the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {label: {"runner": runners[label], "cost": cost.to_dict(),
                      "budget": {str(c): best_size(REFERENCE_SCORES, cost, c) for c in cost.contexts}}
              for label, cost in curves.items()}
    text = report_text(curves)
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    (out / "calibration.md").write_text(text)
    plot(curves, out / "calibration.png")
    return text, out


def plot(curves: dict[str, CostModel], path: str | Path) -> None:
    """Left: forward time against tree tokens, one line per (label, context). Middle: the same
    relative to one token (what the sizer trades against acceptance). Right: expected tokens per
    second against drafted nodes for :data:`REFERENCE_SCORES`, the chosen budget marked."""
    fig, (left, mid, right) = subplots(1, 3, figsize=(15, 4))
    for k, (label, cost) in enumerate(curves.items()):
        color = f"C{k}"
        for j, ctx in enumerate(cost.contexts):
            left.plot(cost.tokens, [1000 * s for s in cost.seconds[j]], marker="o", ms=3, color=color,
                      alpha=1.0 - 0.25 * j, label=f"{label}, context {ctx}")
            mid.plot(cost.tokens, [s / cost.seconds[j][0] for s in cost.seconds[j]], marker="o", ms=3,
                     color=color, alpha=1.0 - 0.25 * j, label=f"{label}, context {ctx}")
        ctx = cost.contexts[0]
        nodes = list(range(min(64, len(REFERENCE_SCORES)) + 1))
        rate = [(1 + sum(REFERENCE_SCORES[:n])) / cost.cost(n + 1, ctx) for n in nodes]
        right.plot(nodes, rate, color=color, label=f"{label} (context {ctx})")
        best = best_size(REFERENCE_SCORES, cost, ctx)
        right.axvline(best, color=color, ls="--", lw=0.8)
        right.annotate(f"budget {best}", (best, rate[best]), color=color, fontsize=8,
                       xytext=(4, 4), textcoords="offset points")
    left.set_xlabel("tokens in one forward (root + tree)")
    left.set_ylabel("forward time (ms)")
    left.set_title("verification cost")
    left.legend(fontsize=7)
    mid.set_xlabel("tokens in one forward (root + tree)")
    mid.set_ylabel("time relative to one token")
    mid.set_title("relative cost")
    mid.legend(fontsize=7)
    right.set_xlabel("drafted nodes kept")
    right.set_ylabel("expected tokens / second")
    right.set_title("reference tree: node i accepted w.p. 0.8 * 0.93^i")
    right.legend(fontsize=7)
    save(fig, path)
