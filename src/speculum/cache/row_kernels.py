"""The row-selection kernels (``row_kernels.cpp``) of the per-query-row sparse-read policies
(:mod:`speculum.kv.rows`):

- ``row_topk(scores [B, n, C] float32, candidates [1 | B, n, C] bool, k)``: per row, the ``k`` best
  candidate columns (ties to the lower column) as a bool mask ``[B, n, C]``;
- ``row_reads(visible [1 | H_kv, n, L+n] bool, L, H_kv)``: a step's per-row choices -> the committed
  slots each KV head reads ``[H_kv, m]``, each row's mask ``[H_kv, n, m+n]`` and whether ``m == L``;
- ``hip_search`` and ``quest_select``: HiP's block search and Quest's page choice per KV head and row,
  the keys (and Quest's page bounds) read in place -> the tokens each row reads ``[H_kv, n, L+n]`` bool.

Built on first use by :mod:`speculum.extensions` (``SPECULUM_KV_KERNELS=0`` turns them off, as the KV
kernels). Where they cannot be built, :func:`row_kernels` returns None and says so once; the policies
then run the torch code, which chooses the same (up to ties, which torch's ``topk`` breaks its own way).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..extensions import KernelsUnavailable, build_extension

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("row_kernels.cpp"),)


@functools.cache
def row_kernels():
    """The compiled row-selection kernels, or None where they cannot be built (the reason is logged once)."""
    try:
        return build_extension("speculum_rowkernels", SOURCES, None, switch="SPECULUM_KV_KERNELS")
    except KernelsUnavailable as e:
        log.warning("row-selection kernels unavailable (%s); sparse-read policies select in torch", e)
        return None


def row_kernels_for(t: torch.Tensor):
    """The row kernels where they serve ``t``'s device (the CPU), else None."""
    return row_kernels() if t.device.type == "cpu" else None


__all__ = ["row_kernels", "row_kernels_for"]
