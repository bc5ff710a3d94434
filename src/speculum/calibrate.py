"""Measure what a verification forward costs on this machine, once, and keep it on disk.

:func:`measure` times :meth:`Runner.forward_tree` over ``n`` tree tokens (``n`` in
:data:`TOKEN_COUNTS`) after ``L`` cached tokens (``L`` in :data:`CONTEXTS`, those that fit), each
the median of several interleaved repetitions after a warm-up. The result, a
:class:`~speculum.tree_sizing.CostModel`, is cached by :func:`load_or_measure` as JSON under
``$SPECULUM_CACHE/calibration/`` keyed by the model's configuration, dtype, device, thread count
and library versions, so it is measured once per model x dtype x device.
``speculum calibrate`` runs it from the command line and plots the curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
import time

import torch

from .tree import DraftTree
from .tree_sizing import CostModel
from .verify import greedy_tokens

TOKEN_COUNTS = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
CONTEXTS = [64, 512, 2048]
REPEATS = 5
FORMAT = 2  # bump when what is measured changes, so that stale cached curves are not reused

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

    cfg = runner.model.config.to_json_string(use_diff=False)
    parts = [str(FORMAT), cfg, str(runner.dtype), str(runner.device), _machine(), torch.__version__,
             transformers.__version__, os.environ.get("SPECULUM_PACKED_LINEAR", "1"), type(runner).__name__,
             getattr(runner, "variant", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _tree(n: int, vocab: int, rng: random.Random) -> DraftTree:
    """``n - 1`` drafted nodes in a binary-heap shape (the root counts as the first token)."""
    k = n - 1
    return DraftTree([rng.randrange(vocab) for _ in range(k)], [(i - 1) // 2 for i in range(k)])


def measure(runner, token_counts=TOKEN_COUNTS, contexts=None, repeats: int = REPEATS,
            progress: bool = False) -> CostModel:
    """Time ``runner.forward_tree`` over each token count at each context length."""
    limit = runner.max_positions - max(token_counts) - 1
    contexts = [c for c in (contexts or CONTEXTS) if c <= limit] or [max(1, min(64, limit))]
    rng = random.Random(0)
    vocab = min(runner.vocab_size, 32000)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(contexts) * (repeats + 1) * len(token_counts), desc="calibrating", unit="fwd")
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
                if bar is not None:
                    bar.update()
        seconds.append([statistics.median(times[n]) for n in token_counts])
    if bar is not None:
        bar.close()
    return CostModel(list(token_counts), contexts, seconds)


def _path(key: str):
    from .models import cache_dir

    return cache_dir() / "calibration" / f"{key}.json"


def load_or_measure(runner, progress: bool = False, force: bool = False) -> CostModel:
    """The runner's cost model: from memory, from disk, or measured now (and saved)."""
    cached = getattr(runner, "_cost_model", None)
    if cached is not None and not force:
        return cached
    key = calibration_key(runner)
    path = _path(key)
    cost = None
    if path.exists() and not force:
        try:
            cost = CostModel.from_dict(json.loads(path.read_text())["cost"])
        except (ValueError, KeyError):
            cost = None
    if cost is None:
        cost = measure(runner, progress=progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": getattr(runner.model.config, "_name_or_path", ""), "dtype": str(runner.dtype),
                "device": str(runner.device), "machine": _machine(), "cost": cost.to_dict()}
        path.write_text(json.dumps(meta, indent=1))
    runner._cost_model = cost
    return cost
