"""CUDA-graph steps: a verification forward over a padded token count is one graph replay.

On a GPU a 135M-parameter model's forward is launch-bound: hundreds of small kernels whose
launches cost more than their work. Each ``(B, K)`` pair, ``B`` a padded token count (1, 2, 4,
…, 80) and ``K`` a bucket of visible key slots (256, 512, … up to the buffer's capacity), is
captured once, lazily, as a CUDA graph over static input tensors and the runner's one static KV
buffer, then replayed.

Everything that changes between steps is *data* in the static inputs, so one capture serves
every cache length and tree shape of its bucket:

- ``ids [B]``, ``positions [B]``: the root and tree tokens, then padding;
- ``length [1]``: committed entries; new entries go to slots ``length .. length+B-1``;
- ``tree [B, B]`` bool: ancestor mask among the new tokens; padding rows see only themselves
  and no real row sees a padding column.

A step that also returns hidden states (the learned drafters read them) is a graph of its own
per set of layers, keyed ``(B, K, layers)``.

The attention mask over ``K`` slots is built inside the graph from those
(:func:`~speculum.attention.padded_visibility`): committed slots are visible (within the window on
sliding layers, key position = slot), the new block follows ``tree``, the rest is hidden. Padding rows write garbage into pending slots past the real ones,
which the engine never commits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..attention import grouped, padded_visibility
from .base import Forward
from .decoder import NativeDecoder

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)
KEY_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@functools.cache
def _causal(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def bucket(value: int, buckets) -> int | None:
    """Smallest bucket ``>= value`` (None when ``value`` exceeds them all)."""
    return next((b for b in buckets if b >= value), None)


def key_buckets(capacity: int) -> tuple[int, ...]:
    """The key-slot buckets of a buffer of ``capacity`` slots: :data:`KEY_BUCKETS` below it, then itself."""
    return tuple(b for b in KEY_BUCKETS if b < capacity) + (capacity,)


def capture_graph(fn, pool):
    """``(graph, out)``: ``fn()`` captured as a CUDA graph in memory ``pool``, after two warm-up calls
    on a side stream (library handles, autotuning, compilation); ``out`` is what the captured call
    returned, which each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class GraphedSteps:
    """Lazily captured CUDA graphs over one static KV buffer ``kv [layers, 2, H_kv, C, d]``."""

    def __init__(self, decoder: NativeDecoder, kv: torch.Tensor, capture: bool = True, compile: bool = False,
                 token_buckets: tuple[int, ...] = TOKEN_BUCKETS):
        """``capture=False`` runs the same padded fixed-shape steps without graphs (any device; tests).
        ``compile=True`` passes each step through ``torch.compile`` (fused kernels) before capture:
        experimental, every bucket compiles once. ``token_buckets``: the padded token counts ``B``
        (one bucket: every step has the same row count, see ``NativeRunner(fixed_rows=...)``)."""
        self.decoder, self.kv, self.capture = decoder, kv, capture
        self.token_buckets = tuple(token_buckets)
        self.step_fn = torch.compile(self._step, dynamic=False) if compile else self._step
        self.capacity = kv.shape[3]
        self.key_buckets = key_buckets(self.capacity)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Forward]] = {}

    def shapes_for(self, length: int, n: int) -> tuple[int, int] | None:
        """``(B, K)`` for ``n`` tokens after ``length`` committed ones, or None (run eagerly)."""
        b = bucket(n, self.token_buckets)
        if b is None or length + b > self.capacity:
            return None
        return b, bucket(length + b, self.key_buckets)

    def _static_inputs(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket ``b``'s inputs: one device tensor ``[2B + 1 + B*B]`` (ids, positions, length, tree)
        filled by a single copy from a pinned host twin, and views of it."""
        if b not in self.inputs:
            dev = self.kv.device
            flat = torch.zeros(2 * b + 1 + b * b, dtype=torch.long, device=dev)
            host = torch.zeros(flat.shape, dtype=torch.long, pin_memory=dev.type == "cuda")
            self.inputs[b] = {
                "flat": flat, "host": host, "host_np": host.numpy(),
                "ids": flat[:b], "positions": flat[b:2 * b], "length": flat[2 * b:2 * b + 1],
                "tree": flat[2 * b + 1:2 * b + 1 + b * b].view(b, b),
            }
        return self.inputs[b]

    def _step(self, b: int, k: int, hidden: tuple[int, ...] = ()) -> Forward:
        """The captured computation: ``[B, V]`` logits (and ``{i: [B, D]}`` hidden states of layers
        ``hidden``) from the static inputs of bucket ``b``."""
        inp = self.inputs[b]
        dec, s = self.decoder, self.decoder.shape
        length, positions = inp["length"], inp["positions"]
        slots = length + torch.arange(b, device=self.kv.device)  # [B]
        full, sliding = padded_visibility(length, positions, inp["tree"].bool(), k, s.sliding_window)
        add = grouped(full, s.group, dec.dtype)
        masks = {False: add, True: add if sliding is full else grouped(sliding, s.group, dec.dtype)}
        return dec.forward(inp["ids"], positions, self.kv, slots, k, masks, hidden_layers=hidden)

    @torch.inference_mode()
    def run(self, length: int, ids: list[int], depths: list[int], tree_mask: np.ndarray | None,
            shapes: tuple[int, int], hidden: tuple[int, ...] = ()) -> Forward:
        """Replay (capturing first if needed) the graph for ``shapes``; returns ``[n, V]`` logits and
        ``{i: [n, D]}`` hidden states of layers ``hidden`` (copies).

        Args:
            length: committed cache entries.
            ids: the ``n`` real tokens (root first); depths: their ``n`` depths below the root.
            tree_mask: ``[n, n]`` bool ancestor mask, or None for a chain (causal).

        The host side is kept to a few numpy writes into a pinned buffer and one copy: on a GPU
        host, each torch op costs microseconds, and this runs once per decoding step.
        """
        b, k = shapes
        n = len(ids)
        inp = self._static_inputs(b)
        if "copied" in inp:
            inp["copied"].synchronize()  # the last copy out of this pinned buffer has finished
        host = inp["host_np"]
        host[:] = 0
        host[:n] = ids
        host[b:2 * b] = length
        host[b:b + n] += depths
        host[2 * b] = length
        tree = host[2 * b + 1:].reshape(b, b)
        np.fill_diagonal(tree, 1)  # padding rows see themselves only
        tree[:n, :n] = tree_mask if tree_mask is not None else _causal(n)
        inp["flat"].copy_(inp["host"], non_blocking=True)
        if inp["host"].is_pinned():
            inp["copied"] = torch.cuda.Event()
            inp["copied"].record()
        if not self.capture:
            out = self.step_fn(b, k, hidden)
        else:
            entry = self.graphs.get((b, k, hidden))
            if entry is None:
                entry = self._capture(b, k, hidden)
            graph, out = entry
            graph.replay()
        return Forward(out.logits[:n].clone(), {i: h[:n].clone() for i, h in out.hidden.items()})

    def _capture(self, b: int, k: int, hidden: tuple[int, ...]):
        entry = self.graphs[(b, k, hidden)] = capture_graph(lambda: self.step_fn(b, k, hidden), self.pool)
        return entry
