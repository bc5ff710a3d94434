"""DuoAttention's view of the cache for a draft (``kv_draft`` ``duo``; Xiao et al., 2024).

The draft reads with the head split :mod:`speculum.kv.duo_attention` learns: on full-attention
layers the *retrieval* KV heads (the highest gates) read every committed entry, the *streaming*
heads only the sinks and the recent window, the pattern the gates were learned with. The choice of
heads is the policy's own (:func:`~speculum.kv.duo_attention.retrieval_heads`), made once per
model, for a share of the gated heads rather than a memory budget (the full cache is kept anyway).

Shapes: ``n`` rows, ``H`` query heads, ``H_kv`` KV heads, ``g = H / H_kv``, ``d`` the head size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..attention import AttentionLayout
from ..errors import SpeculumError
from ..kv.duo_attention import DuoGates, retrieval_heads, shipped_gates
from ..models import target_key

# (keys [H_kv, L, d], values [H_kv, L, d], additive mask [g*n, L]): what a run of heads reads
Reads = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def draft_gates(target: torch.nn.Module, gates: DuoGates | str | Path = "auto") -> DuoGates:
    """``gates``: learned gates, a gates file, or ``"auto"``: the ones shipped for ``target``
    (:class:`SpeculumError` when none ship or the file cannot be read)."""
    if isinstance(gates, DuoGates):
        return gates
    path = shipped_gates(target_key(target)) if str(gates) == "auto" else Path(gates)
    if path is None:
        raise SpeculumError("the duo kv-draft view needs DuoAttention gates learned for the model, and none ship "
                            "for it: learn them with `speculum train-duo --model MODEL --out gates.json` and pass "
                            "duo:gates=gates.json")
    try:
        return DuoGates.load(path)
    except ValueError as e:
        raise SpeculumError(str(e)) from None


def draft_retrieval(gates: DuoGates, layout: AttentionLayout, share: float) -> tuple[tuple[int, ...], ...]:
    """Per layer, the KV heads that read everything: the ``round(share * gated)`` gated heads with
    the highest gates over all layers (none on sliding-window layers, which have no gates)."""
    if not 0 <= share <= 1:
        raise SpeculumError(f"the duo view's retrieval share is in [0, 1], got {share}")
    gates.check(layout)
    gated = int((~gates.alpha.isnan()).sum())
    chosen = retrieval_heads(gates.alpha, round(share * gated))  # [layers, H_kv] bool
    return tuple(tuple(int(h) for h in row.nonzero().flatten()) for row in chosen)


def head_runs(retrieval: tuple[int, ...], kv_heads: int) -> list[tuple[int, int, bool]]:
    """The KV heads ``0 .. kv_heads - 1`` as maximal runs ``(lo, hi, reads_all)`` of one kind, so
    that each run reads a slice of the cache (no gathered copy of a head's keys)."""
    runs: list[tuple[int, int, bool]] = []
    for h in range(kv_heads):
        whole = h in retrieval
        if runs and runs[-1][2] == whole:
            runs[-1] = (runs[-1][0], h + 1, whole)
        else:
            runs.append((h, h + 1, whole))
    return runs


def duo_attend(attend: Callable[..., torch.Tensor], q: torch.Tensor, runs: list[tuple[int, int, bool]], group: int,
               everything: Reads, streaming: Reads) -> torch.Tensor:
    """``q [n, H, d]``: each run of KV heads (:func:`head_runs`) attends over ``everything`` or
    ``streaming`` (the sinks, the window and the pending entries) with ``attend(q, k, v, mask)``
    -> ``[n, H*d]`` (the runs' outputs side by side, in head order)."""
    out = []
    for lo, hi, whole in runs:
        k, v, mask = everything if whole else streaming
        out.append(attend(q[:, lo * group:hi * group], k[lo:hi], v[lo:hi], mask))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
