"""Builds speculum's C++ extensions (the quantized-weight kernels of :mod:`speculum.weights`, the KV-cache
kernels of :mod:`speculum.cache`) with torch's extension machinery, once per machine kind.

An extension is built for this CPU (``-march=native``): AVX-512, AVX2 or portable code paths, chosen
at compile time. Builds are cached under ``$SPECULUM_CACHE/kernels/<key>``, keyed by the sources, the
CPU's instruction-set flags, the target and the torch version, so a cache carried to a machine of
another kind builds anew instead of loading code its CPU cannot run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch
from filelock import FileLock

from .models import cache_dir

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")


class KernelsUnavailable(RuntimeError):
    """An extension could not be built here (no compiler, a failed build, switched off)."""


def cpu_flags() -> tuple[str, ...]:
    """The instruction-set flags of this CPU that the builds depend on (from ``/proc/cpuinfo``)."""
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
    """The ``-march`` extensions are built for: this CPU (``native``) unless ``SPECULUM_KERNEL_ARCH``
    names another (``haswell`` for the AVX2 code, ``x86-64`` for the portable code)."""
    return os.environ.get("SPECULUM_KERNEL_ARCH", "native")


def source_key(sources: Sequence[Path], arch: str) -> str:
    """The cache key of a build of ``sources`` for ``-march=arch`` on this machine."""
    h = hashlib.sha256()
    for source in sources:
        h.update(source.read_bytes())
    h.update(" ".join(cpu_flags()).encode())
    h.update(arch.encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def build_extension(name: str, sources: Sequence[Path], arch: str | None = None, switch: str | None = None):
    """Build (or load the cached build of) the extension ``name`` from ``sources`` for ``-march=arch``
    (default :func:`target_arch`); raises :class:`KernelsUnavailable`. ``switch``: an environment
    variable that turns it off when ``0``. Headers (``.h``) among ``sources`` key the build and are
    not compiled on their own."""
    arch = arch or target_arch()
    if switch and os.environ.get(switch, "1") == "0":
        raise KernelsUnavailable(f"{switch}=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelsUnavailable("no C++ compiler found (install g++, or set CXX)")
    try:
        from torch.utils.cpp_extension import load
    except ImportError as e:  # pragma: no cover - torch always ships it
        raise KernelsUnavailable(str(e)) from None
    key = source_key(sources, arch)
    where = cache_dir() / "kernels" / key
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where) + ".lock"):  # test workers may build at the same moment
        # every build of this directory runs under the lock just taken, so a baton torch's builder left
        # there (``lock``) is a killed build's: left in place, it would make this load wait forever
        (where / "lock").unlink(missing_ok=True)
        try:
            return load(name=f"{name}_{key}", sources=[str(p) for p in sources if p.suffix != ".h"], build_directory=str(where),
                        extra_cflags=["-O3", f"-march={arch}", "-fno-math-errno", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
        except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:  # a compiler error, no ninja
            raise KernelsUnavailable(f"building the kernels failed: {str(e).strip().splitlines()[-1][:300]}") \
                from None
