"""Builds the quantized-weight kernels (``kernels.cpp``, ``layer_ops.cpp``) once per machine kind, with
:mod:`speculum.extensions` (which also builds the KV-cache kernels).

The build targets this CPU (``-march=native``): AVX-512 (with VNNI where present), AVX2 or portable
code. Builds are cached under ``$SPECULUM_CACHE/kernels/<key>``, keyed by the source, the CPU's
instruction-set flags and the torch version, so a cache carried to a machine of another kind
builds anew instead of loading code its CPU cannot run. Where no compiler is found, :func:`kernels`
returns None and says why once; callers then run dequantized float weights.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from ..extensions import KernelsUnavailable, build_extension, cpu_flags, source_key, target_arch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.cpp", "layer_ops.cpp"))


def build_key(arch: str) -> str:
    """The cache key of this machine's build for ``-march=arch``."""
    return source_key(SOURCES, arch)


@functools.cache
def kernels():
    """The compiled kernels module (``qlinear``, ``dequant_rows``, ``isa``), built on first use;
    None where they cannot be built (the reason is logged once)."""
    try:
        return load_kernels()
    except KernelsUnavailable as e:
        log.warning("quantized-weight kernels unavailable (%s); quantized weights will run dequantized "
                    "to float", e)
        return None


@functools.cache
def load_kernels(arch: str | None = None):
    """Build (or load the cached build of) the kernels for ``-march=arch`` (default
    :func:`target_arch`; the tests build ``haswell`` and ``x86-64`` too, to run the AVX2 and portable
    code on an AVX-512 machine); raises :class:`KernelsUnavailable`."""
    return build_extension("speculum_qkernels", SOURCES, arch, switch="SPECULUM_QUANT_KERNELS")


__all__ = ["SOURCES", "KernelsUnavailable", "build_key", "cpu_flags", "kernels", "load_kernels", "target_arch"]
