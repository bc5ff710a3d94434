"""The :class:`~speculum.drafting.self_forward.DraftView` a ``kv_draft`` policy name and its options
make (:mod:`speculum.drafters.kv_draft` describes each view), with every option checked."""

from __future__ import annotations

import torch

from ..errors import SpeculumError
from ..kv.tidal import default_selection_layers
from ..runners.decoder import NativeDecoder
from .duo_view import draft_gates, draft_retrieval
from .self_forward import DraftView

VIEWS = ("streaming", "snapkv", "quest", "duo", "tidal", "tokenselect", "double_sparsity")


def label_count(head_dim: int, channels: int | None) -> int:
    """Double Sparsity's label channels per head: ``channels``, by default the policy's ``head_dim // 8``."""
    return min(head_dim, channels if channels is not None else max(1, head_dim // 8))


def draft_view(policy: str, target: torch.nn.Module, decoder: NativeDecoder, sink: int | None = None,
               window: int | None = None, selected: int = 512, observe: int = 32, pages: int = 32, page: int = 16,
               gates="auto", retrieval: int = 25, dense: int = 2, layers: tuple[int, ...] | None = None,
               threshold: int = 90, channels: int | None = None) -> DraftView:
    """``policy``'s view of ``decoder``'s cache (``target``: the model, whose name finds duo's shipped
    gates); :class:`SpeculumError` on an unknown policy or an option out of range."""
    if policy not in VIEWS:
        raise SpeculumError(f"unknown kv-draft policy {policy!r}; choose from {', '.join(VIEWS)}")
    duo = draft_gates(target, gates) if policy == "duo" else None
    if sink is None:
        sink = duo.sinks if duo is not None else 4
    if window is None:
        window = duo.window if duo is not None else 512 if policy == "streaming" else 256
    if (sink < 0 or min(window, selected, observe, pages, page) < 1 or not 0 <= retrieval <= 100 or dense < 0
            or not 0 <= threshold <= 101 or (channels is not None and channels < 1)):
        raise SpeculumError("a kv-draft view needs sink >= 0, window, selected, observe, pages, page >= 1, "
                            "retrieval in 0..100, dense >= 0, threshold in 0..101 and channels >= 1 (got "
                            f"{sink}, {window}, {selected}, {observe}, {pages}, {page}, {retrieval}, {dense}, "
                            f"{threshold}, {channels})")
    sliding = [layer.sliding for layer in decoder.layers]
    if policy == "tidal":
        layers = default_selection_layers(sliding, dense) if layers is None else list(layers)
        if any(not 0 <= i < len(sliding) or sliding[i] for i in layers):
            raise SpeculumError(f"tidal's selection layers {layers} must be full-attention layers of the model")
    return DraftView(sink, window, selected if policy == "snapkv" else 0, observe,
                     pages=pages if policy == "quest" else 0, page=page,
                     retrieval=draft_retrieval(duo, decoder.layout, retrieval / 100) if duo is not None else None,
                     tidal=tuple(sorted(layers)) if policy == "tidal" else (),
                     tokens=selected if policy in ("tidal", "tokenselect", "double_sparsity") else 0,
                     vote_from=dense if policy == "tokenselect" else None, threshold=threshold / 100,
                     channels=label_count(decoder.shape.head_dim, channels) if policy == "double_sparsity" else 0)
