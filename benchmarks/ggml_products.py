"""llama.cpp's own CPU matrix products (ggml's ``mul_mat``), timed alone for a weight shape and GGML type:
the "llama.cpp ms per product" column next to ours.

    .venv/bin/python benchmarks/ggml_products.py [--threads 2] [--repeats 20] [--no-repack] [--check]

ggml is reached with ctypes through the shared libraries llama-cpp-python ships (``llama_cpp/lib``;
``GGML_LIB_DIR`` overrides), no bindings needed. Per shape: a weight of ``qtype`` with ne = [cols_in,
rows_out], random floats quantized by ggml's ``ggml_quantize_chunk``, and F32 activations ne = [cols_in,
n_rows]; the graph is ``ggml_mul_mat(w, x)`` on the CPU backend with a persistent threadpool, as llama.cpp
runs each product of a decode step (the activations are quantized to Q8 blocks inside the op). As
llama.cpp does by default, a weight whose type the CPU repacks (the CPU_REPACK buffer: Q4_0 and Q4_K on
AVX2, Q8_0 and others on ARM) is stored repacked; ``--no-repack`` matches llama.cpp's ``--no-repack``.
Times: one warm-up, then the median of ``repeats`` graph computes, in milliseconds. ``--check`` compares
the products with numpy's on the weights dequantized by the ``gguf`` package.

ABI assumptions (ggml of llama-cpp-python 0.3.36): the ``ggml_type`` values below, the layouts of
``ggml_init_params``, ``ggml_threadpool_params`` and ``ggml_tensor`` (only ``ne``, ``data``, ``extra``
are read; checked against ``ggml_get_data`` at each weight), and the CPU registry's
``ggml_backend_dev_get_extra_bufts`` returning a NULL-terminated list with a "CPU_REPACK" entry.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import os
import statistics
import time
from pathlib import Path

import numpy as np

TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # enum ggml_type (ggml.h)
SHAPES = ((960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"),
          (49152, 576, "Q8_0"))  # (rows_out, cols_in, qtype)
ROWS = (1, 2, 4, 8, 16, 32)

P, I64, SZ = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t


class InitParams(ctypes.Structure):  # struct ggml_init_params, passed by value to ggml_init
    _fields_ = [("mem_size", SZ), ("mem_buffer", P), ("no_alloc", ctypes.c_bool)]


class ThreadpoolParams(ctypes.Structure):  # struct ggml_threadpool_params (GGML_MAX_N_THREADS = 512)
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


class Tensor(ctypes.Structure):  # struct ggml_tensor (GGML_MAX_DIMS 4, MAX_OP_PARAMS 64, MAX_SRC 10, MAX_NAME 64)
    _fields_ = [("type", ctypes.c_int), ("buffer", P), ("ne", I64 * 4), ("nb", SZ * 4), ("op", ctypes.c_int),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32), ("src", P * 10),
                ("view_src", P), ("view_offs", SZ), ("data", P), ("name", ctypes.c_char * 64), ("extra", P),
                ("padding", ctypes.c_char * 8)]


_SIGNATURES = {  # name: (restype, argtypes)
    "ggml_init": (P, [InitParams]), "ggml_free": (None, [P]), "ggml_tensor_overhead": (SZ, []),
    "ggml_graph_overhead_custom": (SZ, [SZ, ctypes.c_bool]), "ggml_row_size": (SZ, [ctypes.c_int, I64]),
    "ggml_blck_size": (I64, [ctypes.c_int]), "ggml_new_tensor_2d": (P, [P, ctypes.c_int, I64, I64]),
    "ggml_get_data": (P, [P]), "ggml_nbytes": (SZ, [P]), "ggml_mul_mat": (P, [P, P, P]),
    "ggml_new_graph_custom": (P, [P, SZ, ctypes.c_bool]), "ggml_build_forward_expand": (None, [P, P]),
    "ggml_quantize_chunk": (SZ, [ctypes.c_int, P, P, I64, I64, I64, P]),
    "ggml_threadpool_params_init": (None, [ctypes.POINTER(ThreadpoolParams), ctypes.c_int]),
    "ggml_backend_cpu_buffer_type": (P, []), "ggml_backend_buft_name": (ctypes.c_char_p, [P]),
    "ggml_backend_alloc_ctx_tensors_from_buft": (P, [P, P]), "ggml_backend_buffer_free": (None, [P]),
    "ggml_backend_tensor_set": (None, [P, P, SZ, SZ]), "ggml_backend_graph_compute": (ctypes.c_int, [P, P]),
    "ggml_backend_reg_dev_get": (P, [P, SZ]), "ggml_backend_reg_get_proc_address": (P, [P, ctypes.c_char_p]),
    # libggml-cpu
    "ggml_cpu_init": (None, []), "ggml_backend_cpu_init": (P, []), "ggml_backend_cpu_reg": (P, []),
    "ggml_backend_cpu_set_n_threads": (None, [P, ctypes.c_int]),
    "ggml_threadpool_new": (P, [ctypes.POINTER(ThreadpoolParams)]),
    "ggml_backend_cpu_set_threadpool": (None, [P, P]),
}


@functools.cache
def lib():
    """A namespace of the ggml functions above, from libggml-base and libggml-cpu (loaded RTLD_GLOBAL)."""
    found = os.environ.get("GGML_LIB_DIR")
    if found is None:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("llama-cpp-python is not installed (or set GGML_LIB_DIR)")
        found = str(Path(spec.submodule_search_locations[0]) / "lib")
    base = ctypes.CDLL(str(Path(found) / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(Path(found) / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    ns = argparse.Namespace()
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(cpu if hasattr(cpu, name) else base, name)
        fn.restype, fn.argtypes = restype, argtypes
        setattr(ns, name.removeprefix("ggml_"), fn)
    ns.cpu_init()
    return ns


@functools.cache
def _backend(threads: int):
    """A CPU backend computing with ``threads`` threads of a persistent threadpool (as llama.cpp's CLI)."""
    g = lib()
    backend = g.backend_cpu_init()
    params = ThreadpoolParams()
    g.threadpool_params_init(ctypes.byref(params), threads)
    pool = g.threadpool_new(ctypes.byref(params))
    g.backend_cpu_set_n_threads(backend, threads)
    g.backend_cpu_set_threadpool(backend, pool)
    return backend


@functools.cache
def _repack_buft():
    """The CPU_REPACK buffer type from the CPU registry's extra buffer types, or None."""
    g = lib()
    reg = g.backend_cpu_reg()
    addr = g.backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(P), P)(addr)(g.backend_reg_dev_get(reg, 0))
    i = 0
    while bufts and bufts[i]:
        if g.backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


@functools.cache
def _weight(rows_out: int, cols_in: int, qtype: str, repack: bool):
    """(tensor, raw quantized bytes, whether repacked): random N(0, 1) weights quantized to ``qtype``."""
    g, t = lib(), TYPES[qtype]
    if cols_in % g.blck_size(t):
        raise ValueError(f"{qtype} needs cols_in divisible by {g.blck_size(t)}, got {cols_in}")
    floats = np.random.default_rng(0).standard_normal((rows_out, cols_in), dtype=np.float32)
    raw = np.empty(rows_out * g.row_size(t, cols_in), np.uint8)
    if t == TYPES["F32"]:
        raw[:] = floats.reshape(-1).view(np.uint8)
    else:
        g.quantize_chunk(t, floats.ctypes.data, raw.ctypes.data, 0, rows_out, cols_in, None)
    del floats
    for buft in ((_repack_buft(), g.backend_cpu_buffer_type()) if repack else (g.backend_cpu_buffer_type(),)):
        if buft is None:
            continue
        ctx = g.init(InitParams(g.tensor_overhead() + 64, None, True))
        w = g.new_tensor_2d(ctx, t, cols_in, rows_out)
        buf = g.backend_alloc_ctx_tensors_from_buft(ctx, buft)
        view = Tensor.from_address(w)
        if not buf or tuple(view.ne[:2]) != (cols_in, rows_out) or view.data != g.get_data(w):
            raise RuntimeError("ggml_tensor layout or allocation differs from what this module assumes")
        repacked = buft != g.backend_cpu_buffer_type()
        if repacked and not view.extra:  # CPU_REPACK has no layout for this type/shape on this CPU
            g.backend_buffer_free(buf)
            g.free(ctx)
            continue
        assert g.nbytes(w) == raw.nbytes
        g.backend_tensor_set(w, raw.ctypes.data, 0, raw.nbytes)  # CPU_REPACK repacks here
        return w, raw, repacked
    raise AssertionError("unreachable")


@functools.cache
def _graph(rows_out: int, cols_in: int, qtype: str, n_rows: int, repack: bool):
    """(graph, activations as a numpy view, output as a numpy view [n_rows, rows_out]) of mul_mat(w, x)."""
    g = lib()
    w = _weight(rows_out, cols_in, qtype, repack)[0]
    size = 4 * g.tensor_overhead() + g.graph_overhead_custom(8, False) + 4 * (cols_in + rows_out) * n_rows
    ctx = g.init(InitParams(size + 1024, None, False))  # kept for the process's lifetime (cached)
    x = g.new_tensor_2d(ctx, TYPES["F32"], cols_in, n_rows)
    out = g.mul_mat(ctx, w, x)
    graph = g.new_graph_custom(ctx, 8, False)
    g.build_forward_expand(graph, out)
    xs = np.ctypeslib.as_array(ctypes.cast(g.get_data(x), ctypes.POINTER(ctypes.c_float)), (n_rows, cols_in))
    xs[:] = np.random.default_rng(1).standard_normal(xs.shape, dtype=np.float32)
    ys = np.ctypeslib.as_array(ctypes.cast(g.get_data(out), ctypes.POINTER(ctypes.c_float)), (n_rows, rows_out))
    return graph, xs, ys


def _compute(graph, threads: int) -> None:
    if lib().backend_graph_compute(_backend(threads), graph) != 0:
        raise RuntimeError("ggml_backend_graph_compute failed")


def ggml_product_ms(rows_out: int, cols_in: int, qtype: str, n_rows: int, threads: int, repeats: int = 20,
                    repack: bool = True) -> float:
    """Median milliseconds of ggml's CPU ``mul_mat`` of a [rows_out, cols_in] ``qtype`` weight by ``n_rows``
    F32 rows with ``threads`` threads, after one warm-up (weights and graphs are built once and cached)."""
    graph = _graph(rows_out, cols_in, qtype, n_rows, repack)[0]
    _compute(graph, threads)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _compute(graph, threads)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def check(rows_out: int, cols_in: int, qtype: str, n_rows: int = 4, threads: int = 1,
          repack: bool = True) -> tuple[float, bool]:
    """(relative error, repacked): ggml's product against numpy's on the weights dequantized by ``gguf``
    (the error is max |difference| / max |reference|; ~1e-2 expected from the 8-bit activations)."""
    from gguf.quants import GGMLQuantizationType, dequantize

    _, raw, repacked = _weight(rows_out, cols_in, qtype, repack)
    graph, xs, ys = _graph(rows_out, cols_in, qtype, n_rows, repack)
    _compute(graph, threads)
    dense = dequantize(raw.reshape(rows_out, -1), GGMLQuantizationType[qtype]).astype(np.float64)
    ref = xs.astype(np.float64) @ dense.T
    return float(np.abs(ys - ref).max() / np.abs(ref).max()), repacked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-repack", action="store_true", help="plain CPU buffers, as llama.cpp --no-repack")
    ap.add_argument("--check", action="store_true", help="first compare each type's product with numpy's")
    args = ap.parse_args()
    repack = not args.no_repack
    if args.check:
        for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
            for n in (1, 8):
                err, repacked = check(256, 512, qtype, n, args.threads, repack)
                print(f"check {qtype} 256x512 rows={n}: rel err {err:.2e}{' (repacked)' if repacked else ''}")
    print(f"ggml mul_mat, ms per product ({args.threads} threads, median of {args.repeats})")
    print(f"| {'shape':<16} | " + " | ".join(f"{n:>6}" for n in ROWS) + " |")
    print("|" + "-" * 18 + "|" + "|".join("-" * 8 for _ in ROWS) + "|")
    for rows_out, cols_in, qtype in SHAPES:
        ms = [ggml_product_ms(rows_out, cols_in, qtype, n, args.threads, args.repeats, repack) for n in ROWS]
        label = f"{rows_out}x{cols_in} {qtype}" + ("*" if _weight(rows_out, cols_in, qtype, repack)[2] else "")
        print(f"| {label:<16} | " + " | ".join(f"{m:6.3f}" for m in ms) + " |")


if __name__ == "__main__":
    main()
