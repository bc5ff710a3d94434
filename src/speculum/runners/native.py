"""``NativeRunner``: the runner protocol on :class:`~speculum.runners.decoder.NativeDecoder`.

- CPU: eager forwards of the native decoder (fused projections, oneDNN-packed bfloat16
  weights, grouped-query attention without repeated KV heads, no per-module Python overhead).
- CUDA: verification forwards replay CUDA graphs (:mod:`speculum.runners.graphs`) over one
  static KV buffer the runner owns; prefill and shapes outside the graph buckets run eagerly.
  Because the graphs hold that buffer's address, one cache at a time owns it: :meth:`new_cache`
  hands the buffer to a new cache when no live cache holds it, and otherwise returns a private
  cache whose steps run eagerly (a draft model sharing the target's runner, say).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..attention import Step, grouped, visibility, window_skip
from ..cache import SlotCache, SlotPool, StaticKVCache
from ..models import context_length, target_key
from ..tree import DraftTree
from .base import Forward, RunnerBase
from .batched import batched_forward, stack_rows
from .decoder import NativeDecoder
from .invariance import KEY_FLOOR, RowFloors, measure_floors

DEFAULT_GRAPH_CONTEXT = 4096


class NativeRunner(RunnerBase):
    """Runner for Llama-family and Gemma-3 models on the native decoder.

    Args:
        model: a transformers ``*ForCausalLM`` (weights are re-laid out once; the model is untouched,
            and the runner does not keep it alive).
        prefill_chunk: prefill in chunks of this many tokens (bounds attention memory).
        cuda_graphs: capture verification steps as CUDA graphs (default: on CUDA devices, unless
            ``SPECULUM_CUDA_GRAPHS=0``). ``"padded"`` runs the same padded fixed-shape steps
            without capturing them (any device: how the graph path is tested on a CPU).
        graph_context: slots of the static buffer the graphs use; longer sequences run eagerly
            (default ``min(max_positions, 4096)``).
        fixed_rows: run every verification step padded to exactly this many rows (the root and up to
            ``fixed_rows - 1`` drafted tokens), on any device: the reproducible mode. A row's numbers
            then do not depend on how many tokens were drafted, so in bfloat16 a chain draft gives
            bit-for-bit the logits of plain decoding in this mode (measured: BENCHMARKS.md,
            "Reproducible bfloat16"). Trees with siblings still change the attention's summation
            order; the engine's ``chains_only`` avoids them. Sequences beyond ``graph_context`` run
            eagerly and lose the guarantee.
    """

    batched_forward = True  # forward_batch stacks the sequences' rows into one forward (runners.batched)
    _said_unpooled = False  # forward_batch has said once that caches outside a pool run one by one

    def __init__(self, model: torch.nn.Module, prefill_chunk: int = 256, cuda_graphs: bool | str | None = None,
                 graph_context: int | None = None, fixed_rows: int | None = None):
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)
        self.decoder = NativeDecoder.from_hf(model)
        s = self.decoder.shape
        self.shape = s
        self.layout = self.decoder.layout
        self.num_layers = s.layers
        self.device, self.dtype = self.decoder.device, self.decoder.dtype
        self.vocab_size = s.vocab
        self.max_positions = context_length(self.config)
        self.target = target_key(model)  # the model's name for its shipped data (KV policies' attach)
        self.prefill_chunk = prefill_chunk
        self._steps(cuda_graphs, graph_context, fixed_rows)

    def _steps(self, cuda_graphs: bool | str | None, graph_context: int | None, fixed_rows: int | None) -> None:
        """Set up how verification steps run: eagerly, padded, or as CUDA graphs (see ``__init__``),
        and the ``variant`` string that names it in the calibration key."""
        s = self.shape
        self.variant = ("fused" if self.decoder.fused else "exact") + self.decoder.kernel_variant
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("SPECULUM_CUDA_GRAPHS", "1") != "0"
        if fixed_rows is not None and fixed_rows < 1:
            raise ValueError(f"fixed_rows must be >= 1, got {fixed_rows}")
        if fixed_rows is not None and not cuda_graphs:
            cuda_graphs = "padded"
        self.fixed_rows = fixed_rows
        self.floors: RowFloors | None = None  # the reproducible mode's row floors (see invariant())
        self.graphs = None
        self._owner = None  # weak reference to the cache that holds the graphs' buffer
        if cuda_graphs:
            from .graphs import GraphedSteps

            ctx = graph_context or min(self.max_positions, DEFAULT_GRAPH_CONTEXT)
            # zeros, not empty: the graphs attend over every slot of a bucket and mask by addition, so an
            # unwritten slot must hold finite numbers (NaN garbage times a zero weight is still NaN)
            buf = torch.zeros((s.layers, 2, s.kv_heads, ctx, s.head_dim), dtype=self.dtype, device=self.device)
            buckets = {"token_buckets": (fixed_rows,)} if fixed_rows else {}
            self.graphs = GraphedSteps(self.decoder, buf, capture=cuda_graphs != "padded",
                                       compile=os.environ.get("SPECULUM_COMPILE", "0") == "1", **buckets)
            self.variant += f" graphs={cuda_graphs} context={ctx}" + (f" rows={fixed_rows}" if fixed_rows else "")

    def with_fixed_rows(self, rows: int, graph_context: int | None = None) -> NativeRunner:
        """A runner over these same weights (nothing is copied) whose steps are padded to ``rows``
        rows: the ``fixed_rows`` mode of ``__init__``, for a model whose runner already exists."""
        return self._twin(None if self.graphs is None else self.graphs.capture or "padded", graph_context, rows)

    def _twin(self, cuda_graphs: bool | str | None, graph_context: int | None, fixed_rows: int | None) -> NativeRunner:
        """A runner sharing this one's weights and decoder, with its own step set-up (:meth:`_steps`)."""
        twin = object.__new__(NativeRunner)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("graphs", "_owner", "variant")})
        twin._steps(cuda_graphs, graph_context, fixed_rows)
        return twin

    def invariant(self, max_rows: int = 65, fallback_rows: int = 16, floors: RowFloors | None = None) -> NativeRunner:
        """A runner over these same weights (nothing is copied) for the reproducible mode: a token's
        logits do not depend on how many tokens its step verified, so a temperature-0 request gives
        the same output whatever was drafted, in bfloat16 too, provided the engine verifies chains
        (``Engine(chains_only=True)``: tree siblings change the order of the attention's sums).

        Verification steps run eagerly, each matrix product over at least its row floor and the
        attention by its explicit path over at least ``KEY_FLOOR`` keys
        (:mod:`speculum.runners.invariance`, which measures the floors here, on these weights). Where
        some kernel has no floor up to ``max_rows``, every step is padded to ``fallback_rows`` rows
        instead (:meth:`with_fixed_rows`; then drafts must stay shorter than ``fallback_rows``).
        Prefill is the same for every request of a prompt and keeps its usual kernels. ``floors``:
        use these instead of measuring them.
        """
        floors = floors or measure_floors(self.decoder, max_rows)
        if floors is None:
            return self.with_fixed_rows(fallback_rows)
        twin = self._twin(False, None, None)
        twin.floors = floors
        twin.variant += " invariant"
        return twin

    def new_cache(self, capacity: int = 1024) -> StaticKVCache:
        s = self.shape
        free = self._owner is None or self._owner() is None
        if self.graphs is not None and capacity <= self.graphs.capacity and free:
            cache = StaticKVCache(s.layers, s.kv_heads, s.head_dim, self.dtype, self.device, capacity,
                                  buffer=self.graphs.kv)
            self._owner = weakref.ref(cache)
            return cache
        return StaticKVCache(s.layers, s.kv_heads, s.head_dim, self.dtype, self.device, capacity)

    def new_pool(self, slots: int, capacity: int = 1024) -> SlotPool:
        """``slots`` sequences' caches in one buffer (:class:`~speculum.cache.SlotPool`), whose
        :meth:`forward_batch` runs as one forward."""
        s = self.shape
        return SlotPool(s.layers, s.kv_heads, s.head_dim, self.dtype, self.device, slots, capacity)

    @torch.inference_mode()
    def forward_batch(self, caches, roots, trees, prefills=(), hidden_layers=()) -> list[Forward]:
        """One forward for several sequences' trees and prompt chunks (:mod:`speculum.runners.batched`)
        when their caches share one :class:`~speculum.cache.SlotPool`: logits ``[n_j + 1, V]`` per
        tree, its entries pending; each prompt chunk's entries committed. Caches of their own (not
        slots of one pool) run one forward each, and say so once."""
        trees = [t if t.prompts is None else replace(t, prompts=None) for t in trees]  # (not batched yet)
        every = list(caches) + [c for c, _ in prefills]
        pools = {id(c.pool) for c in every if isinstance(c, SlotCache)}
        if len(every) < 2 or len(pools) != 1 or not all(isinstance(c, SlotCache) for c in every):
            if len(every) > 1 and not NativeRunner._said_unpooled:
                NativeRunner._said_unpooled = True
                logging.getLogger("speculum").warning("sequences whose caches are not slots of one pool "
                                                   "(new_pool) run one forward each")
            return super().forward_batch(caches, roots, trees, prefills, hidden_layers)
        if hidden_layers:
            self._check_layers(hidden_layers)
        ids = [[r] + t.tokens for r, t in zip(roots, trees)] + [list(x) for _, x in prefills]
        steps = [self.step_for(c, t) for c, t in zip(caches, trees)]
        steps += [self.chunk_step(c, len(x)) for c, x in prefills]
        for c, x in zip(every, ids):
            c.reserve(c.length + len(x))
        s = self.shape
        rows = stack_rows(every, ids, steps, s.group, s.sliding_window, self.dtype, self.device,
                          [False] * len(caches) + [True] * len(prefills))
        out = batched_forward(self.decoder, every[0].pool.kv, rows, self.floors, hidden_layers)
        for c, x in zip(caches, ids):
            c.pending = len(x)
        for c, x in prefills:
            c.pending = len(x)
            c.commit()
        return out

    def _check_owner(self, cache: StaticKVCache) -> None:
        if cache.fixed and (self._owner is None or self._owner() is not cache):
            raise RuntimeError("this KV cache's buffer belongs to another runner or cache")

    def _run(self, cache: StaticKVCache, ids: list[int], step: Step, last_only: bool,
             hidden_layers: Sequence[int], extra_embeds: torch.Tensor | None = None) -> Forward:
        self._check_owner(cache)
        n = len(ids)
        floors = None if last_only else self.floors  # (prompt rows never run in the reproducible mode)
        if floors is not None:
            if n > floors.up_to:
                raise RuntimeError(f"a {n}-row step in the reproducible mode, whose floors were probed up to "
                                   f"{floors.up_to}")
            rows = max(floors.step, KEY_FLOOR - cache.length)
            if n < rows:
                ids, step = ids + [ids[0]] * (rows - n), _padded(step, rows)
        m = step.n
        cache.reserve(cache.length + m)
        s = self.shape
        full, sliding = visibility(cache.length, step.positions, step.new_mask, s.sliding_window)
        masks = {False: grouped(full, s.group, self.dtype), True: grouped(sliding, s.group, self.dtype)}
        out = self.decoder.forward(torch.tensor(ids, device=self.device), step.positions, cache.kv, cache.length,
                                   cache.length + m, masks, last_only, hidden_layers, floors, extra_embeds,
                                   self._window_start(step) if floors is None else 0)
        cache.pending = m
        if len(ids) > n:  # drop the padding rows
            out = Forward(out.logits[:n], {i: h[:n] for i, h in out.hidden.items()})
        return out

    def _window_start(self, step: Step) -> int:
        """The first slot a sliding-window layer's queries can see in ``step`` (slot = position in
        this runner's caches): keys a whole window behind the step's first position are hidden from
        every row, so those layers skip them. 0 without sliding layers. (Not in the reproducible mode,
        whose rows must not depend on the step around them. Below :data:`~speculum.attention.WINDOW_SKIP_MIN`
        hidden slots the whole span is read, as transformers does.)"""
        window = self.shape.sliding_window
        return 0 if window is None else window_skip(int(step.positions.min()), window)

    @property
    def prompt_rows(self) -> bool:
        """Whether a tree's prompt rows run (not in the reproducible or fixed-row modes, whose steps
        must not depend on what was drafted)."""
        return self.floors is None and self.fixed_rows is None

    @torch.inference_mode()
    def forward(self, cache: StaticKVCache, root: int, tree: DraftTree, hidden_layers: Sequence[int] = ()) -> Forward:
        """Logits ``[n + 1, V]`` (and hidden states ``{i: [n + 1, D]}`` of ``hidden_layers``) for
        ``[root] + tree.tokens``: a CUDA-graph replay where one fits, else an eager forward."""
        if self.graphs is not None and cache.fixed and tree.prompts is None:
            self._check_owner(cache)
            ids = [root] + tree.tokens
            shapes = self.graphs.shapes_for(cache.length, len(ids))
            if shapes is not None:
                if hidden_layers:
                    self._check_layers(hidden_layers)
                mask = None if tree.is_chain else tree.ancestor_mask_np()
                out = self.graphs.run(cache.length, ids, [0] + tree.depths(), mask, shapes,
                                      tuple(sorted(set(hidden_layers))))
                cache.pending = len(ids)
                return out
        return super().forward(cache, root, tree, hidden_layers)


def _padded(step: Step, rows: int) -> Step:
    """``step`` with padding rows up to ``rows``: at the first row's position, each seeing only itself
    (and the cache), unseen by the real rows."""
    n, dev = step.n, step.positions.device
    mask = torch.eye(rows, dtype=torch.bool, device=dev)
    mask[:n, :n] = step.new_mask if step.new_mask is not None else torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    return Step(torch.cat([step.positions, step.positions[:1].expand(rows - n)]), mask)
