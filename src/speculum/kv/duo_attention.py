"""``duo``: DuoAttention (Xiao et al., 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads").

Only some attention heads need the whole context (*retrieval* heads); the others attend mostly
to the first tokens and the most recent ones (*streaming* heads). Each KV head of each layer gets
a gate ``alpha`` in [0, 1], learned once per model on synthetic passkey retrieval: with the model's
weights frozen, every head's output is mixed as ``alpha * full + (1 - alpha) * streaming`` and the
gates minimise the distance between the final hidden states and the full model's at the answer
tokens plus an L1 penalty on ``alpha`` (:mod:`speculum.train.duo_gates`, ``speculum train-duo``).
At inference the heads with the lowest ``alpha`` become streaming heads: they keep only ``sinks``
attention sinks and a ``window`` of recent tokens, at prefill (where they attend that way too, the
paper's Λ-shaped mask) and while decoding; retrieval heads keep and read everything.

How many heads stay retrieval heads: with ``sparsity=S`` (the paper's knob) a fraction ``1 - S``
of them; otherwise the KV budget decides, as a memory budget: for an ``n``-token prompt and a
budget of ``B`` entries per head, a share ``r = (B - c) / (n - c)`` (clipped to [0, 1], ``c =
sinks + window``) of the gated heads keeps everything, so that the cache holds about ``B`` entries
per head on average (``B >= n``: every head; ``n <= c``: none, since a streaming head then holds
the whole prompt anyway). The heads are ranked by ``alpha`` over all layers at once.

Sliding-window layers (Gemma-3) have no gates and keep their window, as without a policy.

Example: 2 layers x 2 KV heads with ``alpha = [[0.9, 0.1], [0.4, 0.7]]``, ``sinks=4, window=16``,
a 100-token prompt and a budget of 50: ``r = (50 - 20) / (100 - 20) = 0.375``, so ``floor(0.375 * 4)
= 1`` head keeps all 100 entries (layer 0, head 0, the highest gate) and the other three keep
tokens ``0..3`` and ``84..99``; a token decoded at position 100 reads, in those three heads, the
sinks and positions ``85..100``.

Streaming heads see, for a row at position ``p``, the sinks and the keys at positions ``> p -
window``: a rule of ``p`` alone, kept exact by masking a buffer a little longer than the window
(:mod:`speculum.cache.split`), so tree verification sees what one-token steps see and every
drafter's output equals plain decoding's under the same policy.

Gates ship for the packaged SmolLM2 (``kv/duo_gates/<model>.json``, found by the model's name);
for another model :meth:`DuoAttentionPolicy.attach` refuses with how to learn them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..attention import AttentionLayout
from ..cache import GroupSpec, SplitHeadCache
from ..errors import SpeculumError
from .base import KVPolicy

GATES_DIR = Path(__file__).parent / "duo_gates"  # the shipped gates: <target key>.json


@dataclass
class DuoGates:
    """One model's learned gates and the streaming pattern they were learned with."""

    alpha: torch.Tensor  # [layers, H_kv] float32 in [0, 1]; NaN on sliding-window layers (no gates)
    sinks: int
    window: int
    model: str = ""  # the target key (speculum.models.target_key) they were learned for
    meta: dict = field(default_factory=dict)  # how they were learned

    def save(self, path: Path) -> Path:
        rows = [[None if math.isnan(a) else round(a, 5) for a in row] for row in self.alpha.tolist()]
        data = {"kind": "duo_gates", "model": self.model, "sinks": self.sinks, "window": self.window,
                "alpha": rows, "meta": self.meta}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | str) -> DuoGates:
        """Read a gates file (ValueError when it is missing or not one)."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
            rows = [[math.nan if a is None else float(a) for a in row] for row in data["alpha"]]
            return cls(torch.tensor(rows, dtype=torch.float32), int(data["sinks"]), int(data["window"]),
                       str(data.get("model", "")), dict(data.get("meta", {})))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read DuoAttention gates from {path}: {e}") from None

    def check(self, layout: AttentionLayout) -> None:
        """SpeculumError unless the gates fit this model's layers, KV heads and sliding-window layers."""
        want = (layout.layers, layout.kv_heads)
        sliding = [layout.is_sliding(i) for i in range(layout.layers)]
        if tuple(self.alpha.shape) != want or [bool(r.isnan().all()) for r in self.alpha] != sliding:
            raise SpeculumError(f"these DuoAttention gates ({tuple(self.alpha.shape)}, learned for "
                                f"{self.model or 'another model'}) do not fit a model of {want[0]} layers x "
                                f"{want[1]} KV heads")


def shipped_gates(model_key: str) -> Path | None:
    """The gates speculum ships for the model named ``model_key``, if any."""
    path = GATES_DIR / f"{model_key}.json"
    return path if model_key and path.is_file() else None


def retrieval_count(n: int, budget: int, sinks: int, window: int, heads: int) -> int:
    """How many of ``heads`` gated heads keep everything for an ``n``-token prompt under a budget of
    ``budget`` entries per head on average (the module docstring's rule)."""
    if budget >= n:
        return heads
    c = sinks + window
    if n <= c:
        return 0
    share = min(1.0, max(0.0, (budget - c) / (n - c)))
    return math.floor(share * heads + 1e-9)


def retrieval_heads(alpha: torch.Tensor, count: int) -> torch.Tensor:
    """Bool ``[layers, H_kv]``: the ``count`` gated heads with the highest ``alpha [layers, H_kv]`` (NaN:
    not gated, never chosen); ties go to the earlier layer and head."""
    flat = alpha.flatten().nan_to_num(nan=-math.inf)
    order = torch.sort(-flat, stable=True).indices[:count]
    out = torch.zeros_like(flat, dtype=torch.bool)
    out[order] = True
    return out.view(alpha.shape) & ~alpha.isnan()


@dataclass
class DuoState:
    """One request's split."""

    retrieval: torch.Tensor  # [layers, H_kv] bool: retrieval heads (False on sliding-window layers)


class DuoAttentionPolicy(KVPolicy):
    """Retrieval heads keep everything; streaming heads keep sinks + a recent window.

    Options:
        gates: a gates file (``speculum train-duo --out``), or ``auto``: the ones shipped for the
            model (:meth:`attach` refuses a model without them).
        sinks, window: the streaming heads' pattern; default the one the gates were learned with
            (the paper's 64 + 256 for the shipped gates). Tiny models in tests use a few tokens.
        sparsity: the fraction of gated heads that stream (the paper's knob); when given, the KV
            budget is not used.
    """

    name = "duo"

    def __init__(self, budget="0.25", gates="auto", sinks=None, window=None, sparsity=None):
        super().__init__(budget)
        self.gates_from = str(gates)
        self.gates = None if self.gates_from == "auto" else DuoGates.load(self.gates_from)
        self._sinks = None if sinks is None else int(sinks)
        self._window = None if window is None else int(window)
        self.sparsity = None if sparsity is None else float(sparsity)
        if (self._sinks is not None and self._sinks < 0) or (self._window is not None and self._window < 1):
            raise ValueError("sinks must be >= 0 and window >= 1")
        if self.sparsity is not None and not 0 <= self.sparsity <= 1:
            raise ValueError(f"sparsity is a fraction in [0, 1], got {self.sparsity}")

    def __repr__(self) -> str:
        knob = f"sparsity={self.sparsity:g}" if self.sparsity is not None else f"budget={self.budget}"
        return f"{self.name}({knob}, gates={self.gates_from})"

    @property
    def sinks(self) -> int:
        return self._sinks if self._sinks is not None else self._gates().sinks

    @property
    def window(self) -> int:
        return self._window if self._window is not None else self._gates().window

    def _gates(self) -> DuoGates:
        if self.gates is None:
            raise SpeculumError("DuoAttention's gates are found when the policy is plugged into a model's "
                                "runner (PolicyRunner); or pass duo:gates=FILE")
        return self.gates

    def attach(self, layout: AttentionLayout, model_key: str) -> None:
        if self.gates_from == "auto":
            if self.gates is not None and self.gates.model != model_key:
                raise SpeculumError(f"this duo policy holds the gates of {self.gates.model}; make another one "
                                    f"for {model_key or 'this model'}")
            path = shipped_gates(model_key)
            if path is None:
                name = model_key or "this model"
                raise SpeculumError(
                    f"DuoAttention needs gates learned for the model, and none ship for {name}: learn them with "
                    f"`speculum train-duo --model MODEL --out gates.json` (minutes on a CPU for a small model) "
                    f"and pass --kv-policy duo:gates=gates.json")
            self.gates = DuoGates.load(path)
        self._gates().check(layout)

    def split(self, layout: AttentionLayout, n: int) -> torch.Tensor:
        """Bool ``[layers, H_kv]``: the retrieval heads for an ``n``-token prompt."""
        gates = self._gates()
        gated = int((~gates.alpha.isnan()).sum())
        if self.sparsity is not None:
            count = gated - round(self.sparsity * gated)
        else:
            count = retrieval_count(n, self.budget.for_length(n), self.sinks, self.window, gated)
        return retrieval_heads(gates.alpha, count)

    def new_cache(self, layout, dtype, device, capacity: int) -> SplitHeadCache:
        self._gates().check(layout)
        return SplitHeadCache(layout, dtype, device, capacity)

    def begin_prefill(self, cache: SplitHeadCache, n: int) -> None:
        s = cache.layout
        retrieval = self.split(s, n)
        sliding = [s.is_sliding(i) for i in range(s.layers)]

        def heads(keep) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(h for h in range(s.kv_heads) if keep(i, h)) for i in range(s.layers))

        specs = [GroupSpec(heads(lambda i, h: bool(retrieval[i, h]))),
                 GroupSpec(heads(lambda i, h: not sliding[i] and not retrieval[i, h]), self.sinks, self.window),
                 GroupSpec(heads(lambda i, h: sliding[i]), 0, s.window)]
        cache.allocate([g for g in specs if any(g.heads)], n)
        cache.state = DuoState(retrieval)

    def store_prefill(self, cache: SplitHeadCache, layer, sliding, kv, scores) -> None:
        cache.store_layer(layer, kv)

    def end_prefill(self, cache: SplitHeadCache, n: int) -> None:
        cache.end_prompt(n)

    def prefill_attend(self, cache: SplitHeadCache, layer, sliding, q, kv, a, b, mask):
        if sliding or bool(cache.state.retrieval[layer].all()):
            return None  # every head over the whole prompt (or the window): the prefill's own attention
        return cache.prompt_attend(layer, q, kv, a, b, mask)

    def attend(self, cache: SplitHeadCache, layer, sliding, q, k, v, step):
        return cache.attend(layer, q, k, v, step)

    def after_commit(self, cache: SplitHeadCache) -> None:
        cache.evict()
