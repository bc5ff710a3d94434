"""The model side of a server: its runner (and whether the reproducible mode runs), each tenant's
methods and the batcher. An engine process holds one (:mod:`.engines`); a server with its model in
its own process holds one beside the HTTP side (:class:`~.app.ServerState`). Nothing here serves
HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ..batching import Batcher, PrefixCache
from ..calibrate import LOOK_EVERY_S, BackgroundCalibration, default_max_batch
from ..engine import default_eos_ids
from ..errors import SpeculumError
from ..kv import make_policy
from ..methods import DRAFT_MODEL_METHODS, ENGINE_METHODS, build_method
from ..runners import NativeRunner, runner_for

SERVABLE_METHODS = tuple(m for m in ENGINE_METHODS if m not in DRAFT_MODEL_METHODS)
log = logging.getLogger("speculum.server")
PROVISIONAL_BATCH = 4  # requests per forward until the calibration picks the number
MAX_POLICY_METHODS = 8  # KV-policy variants of its methods a tenant keeps built (ModelState.get_method)


class ModelState:
    """The model, its methods (built on first use, sharing one runner) per tenant, the batcher.

    **Tenants.** Drafters learn from the requests they serve (the suffix cache, the recycling table,
    ``auto``'s bandit), and what they learnt shows in later responses' speed and acceptance. Each
    tenant (a key the HTTP side computes: :meth:`~.app.ServerState.tenant`) therefore gets its own
    methods. The ``max_tenants`` most recently active tenants keep their state; older ones start
    afresh.

    **Reproducible mode** (``deterministic``): verification runs on
    :meth:`~speculum.runners.native.NativeRunner.invariant`'s runner, whose logits for a token do
    not depend on how many tokens a step verified, and trees are cut to their best chain
    (``Engine(chains_only=True)``). A temperature-0 or seeded request then gives the same output
    each time, whatever the drafters learnt in between, and the output of ``ar``. None (the
    default): on where it is cheap, i.e. the native runner runs the model and this machine's
    kernels have row floors of at most two rows (bfloat16 through oneDNN); elsewhere off, and whole
    trees are verified (float32 output then repeats in practice: its rounding differences hardly
    ever change a token). True: on, with every step padded to a fixed row count where the kernels
    have no floors (slow); False: off.

    **Calibration**: the runner's cost curve (which sizes draft trees and the batch) is read from
    disk, or measured in the background (:class:`~speculum.calibrate.BackgroundCalibration`,
    ``calibrate``; False: another process measures it and this one reads it once it is there):
    the server listens at once, sizes trees by a stand-in curve until the curve is known, and
    :meth:`idle_step` measures one forward at a time while no request runs.

    **Batching**: up to ``max_batch`` requests decode together, one forward per step
    (:class:`~speculum.batching.Batcher`); None picks it from the runner's calibration
    (:func:`~speculum.calibrate.default_max_batch`; :data:`PROVISIONAL_BATCH` until it is known).
    Prompts that start like a recent prompt of the same tenant reuse its KV entries
    (``prefix_cache_mb`` of them at most; 0 turns reuse off). In the reproducible mode a request's
    output does not depend on its batch where the batched kernels keep each row's numbers (tested
    for bfloat16 on oneDNN; see BENCHMARKS.md).
    """

    def __init__(self, model, tokenizer, method: str = "auto", max_tree: int = 64, max_tenants: int = 64,
                 deterministic: bool | None = None, max_batch: int | None = None, prefix_cache_mb: int = 256,
                 draft_head: tuple[str, ...] | None = None, calibrate: bool = True):
        if method not in SERVABLE_METHODS:
            raise SpeculumError(f"unknown method {method!r}; choose from {', '.join(SERVABLE_METHODS)}")
        self.model, self.tokenizer = model, tokenizer
        self.draft_head = draft_head  # the learned drafters' head files (None: the shipped ones)
        self.max_tree, self.max_tenants = max_tree, max_tenants
        self.runner = runner_for(model)
        native = isinstance(self.runner, NativeRunner)
        if deterministic and not native:
            raise SpeculumError("the reproducible mode (--deterministic) needs the native runner")
        self.deterministic = False
        if native and deterministic is not False:
            invariant = self.runner.invariant(max_tree + 1)
            if deterministic or (invariant.floors is not None and invariant.floors.cheap):
                self.runner, self.deterministic = invariant, True
                if invariant.fixed_rows is not None:  # no row floors here: every step padded
                    self.max_tree = min(max_tree, invariant.fixed_rows - 1)
        self.chains_only = self.deterministic
        self.eos_ids = default_eos_ids(model, tokenizer)
        self.tenants: OrderedDict[str, dict[str, object]] = OrderedDict()
        self._tenants_lock = threading.Lock()
        self.get_method(method)  # build the default method before serving
        self.pick_batch, self._resize_to = max_batch is None, None
        self.calibration = BackgroundCalibration(self.runner, calibrate, self._calibrated)
        if max_batch is None:
            cost = self.calibration.cost
            max_batch = PROVISIONAL_BATCH if cost is None else default_max_batch(cost)
        if max_batch < 1:
            raise SpeculumError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self.prefix_cache = PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb > 0 else None
        self.batcher = Batcher(self.runner, max_batch, prefix_cache=self.prefix_cache)

    def idle_timeout(self) -> float | None:
        """How long the model's thread may wait for a request before :meth:`idle_step` has work:
        None (no idle work), 0 (measuring) or a few seconds (another process measures)."""
        if self.calibration.done:
            return 0.0 if self._resize_to is not None and self.batcher.idle else None
        return 0.0 if self.calibration.measuring else LOOK_EVERY_S

    def idle_step(self) -> None:
        """One forward of the background calibration, or the batch resized to its result (on the
        model's thread while no request runs)."""
        if not self.calibration.done:
            self.calibration.step()
        elif self._resize_to is not None and self.batcher.idle:
            self.max_batch, self._resize_to = self._resize_to, None
            self.batcher.resize(self.max_batch)
            log.info("serving up to %d requests per forward (calibrated)", self.max_batch)

    @property
    def batch_after_calibration(self) -> int:
        return self._resize_to or self.max_batch

    def _calibrated(self, cost) -> None:
        if self.pick_batch:
            self._resize_to = default_max_batch(cost)

    def info(self) -> dict:
        """What the HTTP side needs to know of this model side (plain values: it crosses processes)."""
        return {"deterministic": self.deterministic, "max_batch": self.max_batch, "max_tree": self.max_tree,
                "calibrated": self.calibration.done,
                "context": self.runner.max_positions, "eos_ids": self.eos_ids, "vocab_size": self.runner.vocab_size}

    def get_method(self, name: str, tenant: str = "", kv: tuple[str, str] | None = None):
        """``tenant``'s method ``name``, on the full cache or (``kv``: a KV policy and its budget,
        :func:`~speculum.kv.make_policy`) on that policy's runner; built on first use. A tenant
        keeps its :data:`MAX_POLICY_METHODS` most recently used policy variants."""
        with self._tenants_lock:
            methods = self.tenants.get(tenant)
            if methods is None:
                methods = self.tenants[tenant] = OrderedDict()
                while len(self.tenants) > self.max_tenants:
                    self.tenants.popitem(last=False)
            self.tenants.move_to_end(tenant)
            key = name if kv is None else (name, *kv)
            method = methods.get(key)
            if method is not None:
                methods.move_to_end(key)
                return method
        # the server's auto leaves out the learned arm: its head forwards run per sequence, which a
        # batch pays for every step, and its requests cannot reuse cached prefixes (they need the
        # prompt's hidden states); ask for method "eagle" to get it
        method = build_method(name, self.model, self.tokenizer, runner=self.runner, max_tree=self.max_tree,
                              chains_only=self.chains_only, kv_policy=None if kv is None else make_policy(*kv),
                              draft_head=self.draft_head, **({"learned": False} if name == "auto" else {}))
        with self._tenants_lock:
            method = methods.setdefault(key, method)
            variants = [k for k in methods if isinstance(k, tuple)]
            for old in variants[:max(0, len(variants) - MAX_POLICY_METHODS)]:
                del methods[old]
        return method
