"""The target drafting for itself over its own KV cache: the draft forward of self-speculation.

A self-draft runs the target's native decoder with something taken away, and reads the keys and
values the *target* computed for the committed tokens:

- a subset of the layers (SWIFT's layer skipping): a skipped layer passes its input through;
- weight-only quantized copies of the linear layers and the LM head (a quantized self-draft);
- a compressed view of the committed entries (long-context drafting, TriForce / MagicDec style):
  StreamingLLM's first ``sink`` and last ``window`` entries instead of all of them.

Drafted tokens write their keys and values (of the layers that run) into the target cache's free
slots after the committed ones, ``length + used ..``, where the verification forward writes its own
entries next: nothing of the target's state changes, and no second cache or catch-up prefill is
needed. Rows see the committed entries of the view, their ancestors among the pending draft
entries (``visible``), and themselves; sliding-window layers apply their window.

Works on the plain KV caches where slot ``c`` holds position ``c`` (the static cache and a batch
pool's slot), not under a KV policy.

Shapes: ``n`` rows, ``p`` draft entries already pending this step, ``L`` committed entries, ``V``
the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..attention import grouped, in_window
from ..cache import KVCache
from ..cache.positioned import PositionedKVCache
from ..cache.static import StaticKVCache
from ..errors import SpeculumError
from .decoder import Layer, NativeDecoder


@dataclass(frozen=True)
class DraftView:
    """Which committed entries a draft reads: all (``window=None``), or the first ``sink`` and the
    last ``window`` (StreamingLLM's attention sinks and recent window)."""

    sink: int = 4
    window: int | None = None

    def spans(self, length: int) -> list[tuple[int, int]]:
        """Committed slot ranges ``[(lo, hi)]`` read with ``length`` committed entries."""
        if self.window is None or length <= self.sink + self.window:
            return [(0, length)]
        return [(0, self.sink), (length - self.window, length)]


def check_plain_cache(cache: KVCache, decoder: NativeDecoder, who: str) -> None:
    """Raise :class:`SpeculumError` unless ``cache`` is a plain native KV cache of ``decoder``'s layout."""
    kv = getattr(cache, "kv", None)
    s = decoder.shape
    if (not isinstance(cache, StaticKVCache) or isinstance(cache, PositionedKVCache) or kv is None
            or tuple(kv.shape[:3]) != (s.layers, 2, s.kv_heads) or kv.shape[4] != s.head_dim):
        raise SpeculumError(f"{who} drafts over the target's own KV cache: it needs the native runner's plain "
                            "cache (no KV policy; for long prompts use a kv-draft view instead)")


class SelfDraft:
    """The target's decoder, with ``layers`` only (default all; indices into ``decoder.layers``),
    optionally other ``weights`` per layer (quantized copies, :mod:`speculum.runners.quantized`) and
    another ``head`` (``[n, D]`` final-norm output -> ``[n, V]``), reading ``view`` of the committed
    entries.

    Per draft step: :meth:`begin` with the target's cache, then :meth:`run` once per depth.
    """

    def __init__(self, decoder: NativeDecoder, layers: Sequence[int] | None = None,
                 weights: Sequence[Layer] | None = None, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 view: DraftView = DraftView()):
        self.decoder = decoder
        self.layers = list(range(decoder.shape.layers)) if layers is None else sorted(layers)
        self.weights = list(decoder.layers) if weights is None else list(weights)
        self.head = head
        self.view = view
        self.cache: KVCache | None = None
        self.used = 0

    def begin(self, cache: KVCache, rows: int) -> None:
        """Start a draft step on the target's ``cache`` (committed entries only), with room for
        ``rows`` draft entries in all."""
        cache.reserve(cache.length + rows)  # before any write: a growth keeps only committed entries
        self.cache, self.used = cache, 0
        self.pending_pos = torch.empty(0, dtype=torch.int64, device=self.decoder.device)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
            committed: int | None = None) -> torch.Tensor:
        """Rows ``ids [n]`` at ``positions [n]``; ``visible [n, p + n]`` bool over this step's pending
        draft entries (the rows' own last). ``committed``: read only the first ``committed`` entries
        (default all; the view then applies). Returns logits ``[n, V]``."""
        dec, s, cache = self.decoder, self.decoder.shape, self.cache
        n = ids.shape[0]
        length = cache.length if committed is None else committed
        at = cache.length + self.used
        cache.reserve(at + n)
        kv = cache.kv
        spans = self.view.spans(length)
        key_pos = torch.cat([torch.arange(lo, hi, device=dec.device) for lo, hi in spans]
                            + [self.pending_pos, positions])
        seen = sum(hi - lo for lo, hi in spans)
        mask = torch.cat([torch.ones(n, seen, dtype=torch.bool, device=dec.device), visible], dim=1)
        masks = {False: grouped(mask, s.group, dec.dtype), True: None}
        if s.sliding_window is not None:
            masks[True] = grouped(mask & in_window(key_pos, positions, s.sliding_window), s.group, dec.dtype)
        contiguous = len(spans) == 1 and spans[0][1] == cache.length

        def keys(t: torch.Tensor) -> torch.Tensor:  # [H_kv, C, d] -> [H_kv, seen + p + n, d]
            if contiguous:
                return t[:, spans[0][0]:at + n]
            return torch.cat([t[:, lo:hi] for lo, hi in spans] + [t[:, cache.length:at + n]], dim=1)

        def attend(i: int, layer: Layer, q, k, v):
            kv[i, 0, :, at:at + n] = k.transpose(0, 1)
            kv[i, 1, :, at:at + n] = v.transpose(0, 1)
            return dec.attend(q, keys(kv[i, 0]), keys(kv[i, 1]), masks[layer.sliding])

        h = dec.embed_ids(ids)
        rope = dec.rope(positions)
        for i in self.layers:
            h = dec.layer_forward(i, self.weights[i], h, rope, attend)
        self.used += n
        self.pending_pos = torch.cat([self.pending_pos, positions])
        if self.head is None:
            return dec.logits(h)
        logits = self.head(dec.final_norm(h))
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits
