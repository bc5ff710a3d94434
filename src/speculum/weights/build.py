"""Builds the quantized-weight kernels (``kernels.cpp``) with torch's extension machinery, once per
machine kind.

The build targets this CPU (``-march=native``): AVX-512 (with VNNI where present), AVX2 or portable
code. Builds are cached under ``$SPECULUM_CACHE/kernels/<key>``, keyed by the source, the CPU's
instruction-set flags and the torch version, so a cache carried to a machine of another kind
builds anew instead of loading code its CPU cannot run. Where no compiler is found, :func:`kernels`
returns None and says why once; callers then run dequantized float weights.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch
from filelock import FileLock

from ..models import cache_dir

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.cpp", "layer_ops.cpp"))
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")


def cpu_flags() -> tuple[str, ...]:
    """The instruction-set flags of this CPU that the build depends on (from ``/proc/cpuinfo``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return tuple(f for f in ISA_FLAGS if f in have)
    return ()


def target_arch() -> str:
    """The ``-march`` the kernels are built for: this CPU (``native``) unless ``SPECULUM_KERNEL_ARCH``
    names another (``haswell`` for the AVX2 code, ``x86-64`` for the portable code)."""
    return os.environ.get("SPECULUM_KERNEL_ARCH", "native")


def build_key(arch: str) -> str:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update(" ".join(cpu_flags()).encode())
    h.update(arch.encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


class KernelsUnavailable(RuntimeError):
    """The kernels could not be built here (no compiler, a failed build)."""


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
    arch = arch or target_arch()
    if os.environ.get("SPECULUM_QUANT_KERNELS", "1") == "0":
        raise KernelsUnavailable("SPECULUM_QUANT_KERNELS=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelsUnavailable("no C++ compiler found (install g++, or set CXX)")
    try:
        from torch.utils.cpp_extension import load
    except ImportError as e:  # pragma: no cover - torch always ships it
        raise KernelsUnavailable(str(e)) from None
    key = build_key(arch)
    where = cache_dir() / "kernels" / key
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where) + ".lock"):  # test workers may build at the same moment
        try:
            return load(name=f"speculum_qkernels_{key}", sources=[str(p) for p in SOURCES], build_directory=str(where),
                        extra_cflags=["-O3", f"-march={arch}", "-fno-math-errno", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:  # a compiler error, no ninja
            raise KernelsUnavailable(f"building the kernels failed: {str(e).strip().splitlines()[-1][:300]}") \
                from None
