"""kvpress's presses (the nearest to each speculum policy, :data:`PRESSES`) on speculum's RULER-style tasks (run in kvpress's own venv).

kvpress pins its own transformers range, so this script runs in a separate environment and
imports nothing from speculum but the task generator (``src/speculum/bench/ruler.py``, loaded by
path: standard library only). It builds the same samples as ``speculum longctx`` (same tasks,
seeds, lengths, chat template, question and answer prefix) and runs kvpress's
``kv-press-text-generation`` pipeline on them: the context is compressed during prefill, then the
question is appended and answered greedily (kvpress's default, query-agnostic protocol; compare
with ``speculum longctx --protocol agnostic``). A budget of 25% is kvpress's
``compression_ratio=0.75``.

Per sample it records accuracy (``string_match_all``), the KV bytes in kvpress's cache after
prefill, the peak RSS increase during the run (``VmHWM`` reset through ``/proc/self/clear_refs``
before each run, minus ``VmRSS`` then) and wall time.

Set-up and run (from the repository root):

    python3 -m venv .venv-kvpress
    .venv-kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5
    DIR=$(.venv/bin/python -c "import speculum.models as m; print(m._dequantized_dir(m.Path(m.resolve('default')[1])))")
    .venv-kvpress/bin/python benchmarks/kvpress_compare.py --model-dir $DIR --lengths 2048 --samples 3 \\
        --out docs/longctx-kvpress

``speculum longctx`` caps oneDNN's primitive cache at 16 kernels (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``);
set the same variable here to compare the two processes on equal terms (recorded in results.json).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    ComposedPress,
    KeyDiffPress,
    KnormPress,
    MergingPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ruler", ROOT / "src/speculum/bench/ruler.py")
ruler = importlib.util.module_from_spec(_spec)
sys.modules["ruler"] = ruler  # dataclasses look their module up
_spec.loader.exec_module(ruler)


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> int:
    """As ``speculum longctx``: freed memory returned to the system (glibc), then the peak mark reset."""
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss("VmRSS")


# speculum's policy -> kvpress's nearest press, built for a kept fraction ``budget`` of the context
PRESSES = {
    "streaming": lambda budget: StreamingLLMPress(compression_ratio=1 - budget),
    "snapkv": lambda budget: SnapKVPress(compression_ratio=1 - budget),
    "pyramidkv": lambda budget: PyramidKVPress(compression_ratio=1 - budget),
    "adakv": lambda budget: AdaKVPress(SnapKVPress(compression_ratio=1 - budget)),
    # ThinK on top of SnapKV as in the paper: half the key channels pruned, tokens to the rest of the budget
    "think": lambda budget: ComposedPress([SnapKVPress(compression_ratio=1 - min(1.0, budget / 0.75)),
                                           ThinKPress(key_channel_compression_ratio=0.5)]),
    # kvpress has no D2O: its merge-on-evict wrapper around SnapKV's scores is the nearest
    "d2o": lambda budget: MergingPress(press=SnapKVPress(compression_ratio=1 - budget)),
    # DuoAttentionPress is left out: its head patterns come from GitHub or from on-the-fly scoring over a
    # Hugging Face dataset (kmfoda/booksum), neither reachable offline
    "keydiff": lambda budget: KeyDiffPress(compression_ratio=1 - budget),
    "tova": lambda budget: TOVAPress(compression_ratio=1 - budget),
    "knorm": lambda budget: KnormPress(compression_ratio=1 - budget),
}


def make_press(name: str, budget: float):
    if name == "none":
        return None
    if name not in PRESSES:
        raise SystemExit(f"unknown press {name}; choose from none, {', '.join(PRESSES)}")
    return PRESSES[name](budget)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face directory of the model (speculum's dequantized GGUF)")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--tasks", default="niah_single,niah_multikey,passkey")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--values", default="number", help="needle value kinds, as speculum longctx --values")
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the context kept")
    ap.add_argument("--presses", default="none,streaming,snapkv")
    ap.add_argument("--out", default="kvpress-out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model's dtype (float32 on a CPU without bfloat16 instructions, where it is emulated)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    max_pos = model.config.max_position_embeddings

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    records = []
    warm = False
    for length in [int(x) for x in args.lengths.split(",")]:
        for task in args.tasks.split(","):
            for seed in range(args.samples):
                t = ruler.make_task(task, min(length, max_pos - 128), seed, count,
                                    tuple(args.values.split(",")))  # as speculum longctx
                if not warm:
                    pipe(t.context[-2000:], question="\n\n" + t.question, answer_prefix=t.answer_prefix,
                         max_new_tokens=4)
                    warm = True
                for name in args.presses.split(","):
                    press = make_press(name, args.budget)
                    cache = DynamicCache()
                    start = reset_peak()
                    t0 = time.perf_counter()
                    out = pipe(t.context, question="\n\n" + t.question, answer_prefix=t.answer_prefix,
                               press=press, cache=cache, max_new_tokens=t.max_new_tokens)["answer"]
                    elapsed = time.perf_counter() - t0
                    peak = rss("VmHWM")
                    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                    records.append({"press": name, "length": length, "task": task, "seed": seed,
                                    "accuracy": ruler.string_match_all(out, t.expected), "kv_bytes": kv,
                                    "peak_rss_increase_bytes": peak - start, "peak_rss_bytes": peak,
                                    "time_s": round(elapsed, 3), "output": out})
                    print(name, length, task, seed, records[-1]["accuracy"], kv, (peak - start) >> 20, "MiB",
                          f"{elapsed:.1f}s", repr(out[:50]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.presses.split(","):
        for length in sorted({r["length"] for r in records}):
            rs = [r for r in records if r["press"] == name and r["length"] == length]
            rows.append({"press": name, "budget": args.budget if name != "none" else 1.0, "length": length,
                         "samples": len(rs), "accuracy": round(100 * statistics.mean(r["accuracy"] for r in rs), 1),
                         "kv_bytes": int(statistics.mean(r["kv_bytes"] for r in rs)),
                         "peak_rss_increase_bytes": max(r["peak_rss_increase_bytes"] for r in rs),
                         "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                         "time_s": round(statistics.mean(r["time_s"] for r in rs), 2)})
    (out / "results.json").write_text(json.dumps({"rows": rows, "records": records, "dtype": args.dtype,
                                                  "versions": {"torch": torch.__version__,
                                                               "kvpress": _version("kvpress"),
                                                               "transformers": _version("transformers")},
                                                  "onednn_primitive_cache":
                                                      os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")},
                                                 indent=1))
    for r in rows:
        print(r)


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    main()
