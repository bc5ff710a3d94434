"""Which runner runs a model, built once per model and kind, and the release of weights it duplicates.

Runners are memoised here, in weak-keyed tables (a model that is freed takes its runners with it;
runners refer to their model weakly, so the tables keep nothing alive):

- :func:`runner_for` returns the model's runner of a kind (``native``, ``hf`` or ``auto``);
- :func:`use_runner` sets the kind a model's engine methods use by default;
- :func:`release_model_weights` frees the transformers copies of the weights a native runner has
  re-laid out; afterwards only the native runner can run the model.
"""

from __future__ import annotations

import os
import weakref

import torch

from ..errors import SpeculumError
from .decoder import unsupported_reason
from .hf import HFRunner
from .native import NativeRunner

RUNNER_KINDS = ("auto", "native", "hf")

_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {kind: runner}
_DEFAULT_KIND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> kind set by use_runner
_RELEASED: weakref.WeakSet = weakref.WeakSet()  # models whose layer weights went to their native runner


def _check_kind(kind: str) -> None:
    if kind not in RUNNER_KINDS:
        raise SpeculumError(f"unknown runner {kind!r}; choose from {', '.join(RUNNER_KINDS)}")


def use_runner(model: torch.nn.Module, kind: str) -> None:
    """Make ``kind`` (``auto``, ``native`` or ``hf``) the runner every engine method builds for ``model``."""
    runner_for(model, kind)  # fails now, clearly, if the kind cannot run this model
    _DEFAULT_KIND[model] = kind


def runner_for(model: torch.nn.Module, kind: str | None = None):
    """The model's runner, built once per kind (re-laying weights takes time).

    ``kind``: ``"native"`` (:class:`~speculum.runners.native.NativeRunner`; raises
    :class:`~speculum.errors.SpeculumError` for an unsupported architecture), ``"hf"``
    (:class:`~speculum.runners.hf.HFRunner`, any transformers causal LM) or ``"auto"``: native where
    the architecture is supported, else hf. None: the kind set by :func:`use_runner` for this model,
    else ``SPECULUM_RUNNER``, else ``auto``.
    """
    kind = kind or _DEFAULT_KIND.get(model) or os.environ.get("SPECULUM_RUNNER", "auto")
    _check_kind(kind)
    if kind == "auto":
        kind = "hf" if unsupported_reason(model.config) else "native"
    elif kind == "native" and (reason := unsupported_reason(model.config)):
        raise SpeculumError(f"the native runner does not support {reason}; use --runner hf")
    if kind == "hf" and getattr(model, "speculum_quant", None):
        raise SpeculumError("this model's weights are quantized (--weights "
                            f"{getattr(model, 'speculum_weights', 'gguf')}), which only the native runner runs; "
                            "load it with --weights float to run it with transformers (the hf methods, --runner hf)")
    if kind == "hf" and weights_released(model):
        raise SpeculumError("this model's layer weights were released to its native runner "
                            "(release_model_weights); load the model again to run it with transformers")
    runners = _RUNNERS.setdefault(model, {})
    if kind not in runners:
        runners[kind] = NativeRunner(model) if kind == "native" else HFRunner(model)
    return runners[kind]


def weights_released(model: torch.nn.Module) -> bool:
    """Whether :func:`release_model_weights` has run on ``model`` (then only the native runner can run it)."""
    return model in _RELEASED


def release_if_native(model: torch.nn.Module) -> int:
    """:func:`release_model_weights` when ``model`` runs on the native runner (for commands that never
    run the ``hf`` methods); returns the bytes freed (0 on the hf runner)."""
    if isinstance(runner_for(model), NativeRunner):
        return release_model_weights(model)
    return 0


@torch.no_grad()
def release_model_weights(model: torch.nn.Module) -> int:
    """Free the transformers model's decoder-layer linear weights that its native runner holds copies of.

    The native runner re-lays the projections out (fused QKV and gate/up, oneDNN-packed in
    bfloat16 on the CPU), so after it is built the process holds every linear weight twice: about
    0.2 GB for SmolLM2-135M in bfloat16. This replaces each layer's ``nn.Linear`` weights (and biases)
    with meta tensors of the same shape. Afterwards the model runs only through
    ``runner_for(model, "native")``: the hf runner and transformers' ``generate`` (the ``hf``
    methods) refuse it with a :class:`~speculum.errors.SpeculumError`. Embeddings, norms and the
    output head stay (the native decoder reads the embedding table in place).

    Raises :class:`~speculum.errors.SpeculumError` if the native runner cannot run the model.
    Returns the bytes no longer referenced by anything (weights the native decoder shares, such as
    the unfused float32 ``o_proj``, stay alive through it and are not counted).
    """
    runner = runner_for(model, "native")
    held = set()
    for layer in runner.decoder.layers:
        for part in vars(layer).values():
            for t in (getattr(part, "weight", None), getattr(part, "bias", None)):
                if isinstance(t, torch.Tensor):
                    held.add(t.untyped_storage().data_ptr())
    freed = 0
    for hf_layer in model.model.layers:
        for module in hf_layer.modules():
            if not isinstance(module, torch.nn.Linear) or module.weight.device.type == "meta":
                continue
            for name in ("weight", "bias"):
                t = getattr(module, name)
                if t is None:
                    continue
                if t.untyped_storage().data_ptr() not in held:
                    freed += t.numel() * t.element_size()
                setattr(module, name, torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False))
    _RELEASED.add(model)
    return freed
