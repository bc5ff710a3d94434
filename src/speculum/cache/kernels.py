"""The KV-cache kernels (``kv_kernels.cpp``): attention read where a policy's cache stores its entries.

- ``quant_attend``: over KIVI's packed low-bit store (:class:`~speculum.cache.QuantKVCache`) and its
  full-precision residual window, scores and value sums computed from the codes;
- ``gear_attend``: ``quant_attend`` over GEAR's store (:class:`~speculum.cache.gear.GearKVCache`), each
  piece's scores and value sums corrected by its low-rank terms and outliers in the same pass
  (``gear_kernels.h``);
- ``zip_attend``: over ZipCache's mixed-precision store (:class:`~speculum.cache.mixed.MixedKVCache`), each
  chunk's two precisions read from their codes where they are stored (``zip_kernels.h``), and the window;
- ``slot_attend``: over chosen slots of a float cache (:meth:`~speculum.cache.PositionedKVCache.attend_slots`),
  one index list per KV head, and the step's new entries, without gathering a copy.

Built for this CPU on first use by :mod:`speculum.extensions` (AVX-512, AVX2 or portable code;
``SPECULUM_KERNEL_ARCH`` picks another target, ``SPECULUM_KV_KERNELS=0`` turns them off). Where they
cannot be built, :func:`kv_kernels` returns None and says so once; the caches then run their torch
code (dequantize, gather, attend), which gives the same results to float rounding.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..extensions import KernelsUnavailable, build_extension

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("kv_kernels.cpp", "zip_kernels.h", "gear_kernels.h"))


@functools.cache
def load_kv_kernels(arch: str | None = None):
    """Build (or load the cached build of) the KV kernels for ``-march=arch`` (default: this CPU, or
    ``SPECULUM_KERNEL_ARCH``); raises :class:`~speculum.extensions.KernelsUnavailable`."""
    return build_extension("speculum_kvkernels", SOURCES, arch, switch="SPECULUM_KV_KERNELS")


@functools.cache
def kv_kernels():
    """The compiled KV kernels module, or None where it cannot be built (the reason is logged once)."""
    try:
        return load_kv_kernels()
    except KernelsUnavailable as e:
        log.warning("KV-cache kernels unavailable (%s); quantized and sparse KV reads run in torch "
                    "(dequantized or gathered copies)", e)
        return None


def kernels_for(t: torch.Tensor, head_dim: int):
    """The KV kernels where they serve ``t``'s device and a head dim of ``head_dim`` (a multiple of
    the build's vector width), else None."""
    if t.device.type != "cpu":
        return None
    ops = kv_kernels()
    return ops if ops is not None and head_dim % ops.vector_width == 0 else None


_EMPTY = torch.empty(0, dtype=torch.bool)


def mask3(visible: torch.Tensor | None) -> torch.Tensor:
    """A visibility mask ``[n, L]`` or ``[H_kv, n, L]`` (True = visible) as the kernels take it:
    contiguous bool ``[1 | H_kv, n, L]``, or an empty tensor for None (everything visible)."""
    if visible is None:
        return _EMPTY
    if visible.dim() == 2:
        visible = visible[None]
    return visible.to(torch.bool).contiguous()


__all__ = ["KernelsUnavailable", "kernels_for", "kv_kernels", "load_kv_kernels", "mask3"]
