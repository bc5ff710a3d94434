"""Native runner against the Hugging Face runner on one device: exactness, then forward cost.

Usage::

    python benchmarks/native_runner.py --model default --device cuda --out DIR

1. float32: greedy output of the engine (``ar`` and two drafters) on the native runner against
   ``ar`` on the Hugging Face runner, token for token, and the largest logit difference of one
   tree forward;
2. bfloat16: the time of one forward over k = 1 … 64 tokens at 512 cached tokens for both
   runners (the median of interleaved repetitions after a warm-up, synchronised), written as
   ``forward_cost.{json,md,png}``.

End-to-end tok/s comes from ``speculum bench`` (see BENCHMARKS.md), not from this script.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import speculum
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.ngram import NgramDrafter
from speculum.drafters.suffix import SuffixDrafter
from speculum.engine import Engine
from speculum.prompts import encode_prompt
from speculum.runners import HFRunner, NativeRunner
from speculum.tree import DraftTree
from speculum.verify import greedy_tokens

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    ("Summarize: The mitochondria is the powerhouse of the cell. It produces ATP through respiration, "
     "which the cell uses as energy for almost every process."),
    "What is 17 times 23? Explain step by step.",
]
COUNTS = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def exactness(model_name: str, device: str, new_tokens: int) -> dict:
    model, tok = speculum.load(model_name, dtype="float32", device=device)
    hf, native = HFRunner(model), NativeRunner(model)
    ids = [encode_prompt(tok, p, None) for p in PROMPTS]
    ref = [Engine(hf, AutoregressiveDrafter(), tok).generate(x, new_tokens).tokens for x in ids]
    out = {}
    for name, drafter in (("ar", AutoregressiveDrafter()), ("ngram", NgramDrafter()), ("suffix", SuffixDrafter())):
        eng = Engine(native, drafter, tok)
        got = [eng.generate(x, new_tokens).tokens for x in ids]
        out[name] = sum(a == b for a, b in zip(got, ref))
    # one tree forward after a prompt: logits of both runners
    rng = random.Random(0)
    tree = DraftTree([rng.randrange(1000) for _ in range(15)], [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    diffs = []
    for runner in (hf, native):
        cache = runner.new_cache(len(ids[0]) + 32)
        runner.prefill(cache, ids[0])
        diffs.append(runner.forward_tree(cache, ids[0][-1], tree).float())
    out["max_logit_diff"] = (diffs[0] - diffs[1]).abs().max().item()
    out["prompts"] = len(ids)
    del model
    return out


def forward_cost(model, context: int, repeats: int, runner_names, counts) -> dict:
    runners = {name: HFRunner(model) if name == "hf" else NativeRunner(model) for name in runner_names}
    rng = random.Random(0)
    vocab = min(next(iter(runners.values())).vocab_size, 32000)
    caches = {}
    for name, r in runners.items():
        caches[name] = r.new_cache(context + max(counts) + 1)
        r.prefill(caches[name], [rng.randrange(vocab) for _ in range(context)])
    times = {name: {n: [] for n in counts} for name in runners}
    for rep in range(repeats + 1):
        for n in counts:
            for name, r in runners.items():
                tree = DraftTree([rng.randrange(vocab) for _ in range(n - 1)], [(i - 1) // 2 for i in range(n - 1)])
                sync()
                t0 = time.perf_counter()
                greedy_tokens(r.forward_tree(caches[name], rng.randrange(vocab), tree))
                sync()
                if rep:
                    times[name][n].append(time.perf_counter() - t0)
                caches[name].pending = 0
    return {name: {n: 1000 * statistics.median(v) for n, v in t.items()} for name, t in times.items()}


def replay_ms(model, context: int, counts, repeats: int = 200) -> dict:
    """GPU time of one CUDA-graph replay per token count (events around ``repeats`` replays): the
    device's share of a step, without the host work around it."""
    runner = NativeRunner(model)
    cache = runner.new_cache(context + max(counts) + 1)
    runner.prefill(cache, list(range(100, 100 + context)))
    out = {}
    for n in counts:
        tree = DraftTree.chain(list(range(200, 200 + n - 1)))
        runner.forward_tree(cache, 5, tree)  # captures the graph
        cache.pending = 0
        graph, _ = runner.graphs.graphs[runner.graphs.shapes_for(cache.length, n) + ((),)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[n] = start.elapsed_time(end) / repeats
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default=None)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--runners", default="hf,native", help="hf and/or native (default: %(default)s)")
    ap.add_argument("--counts", default=",".join(map(str, COUNTS)), help="tokens per forward to time")
    ap.add_argument("--out", default="native-out")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    if not args.skip_exactness:
        report["float32_exactness"] = exactness(args.model, device, args.new_tokens)
        print("float32 exactness:", report["float32_exactness"], flush=True)
    counts = [int(c) for c in args.counts.split(",")]
    model, _ = speculum.load(args.model, dtype="bfloat16", device=device)
    cost = forward_cost(model, args.context, args.repeats, args.runners.split(","), counts)
    report["bf16_forward_ms"] = cost
    lines = [f"bfloat16 forward time in ms at {args.context} cached tokens ({report['device']})", "",
             "| runner | " + " | ".join(str(n) for n in counts) + f" | {counts[-1]} / {counts[0]} |",
             "|---|" + "---:|" * (len(counts) + 1)]
    for name, row in cost.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[n]:.2f}" for n in counts)
                     + f" | {row[counts[-1]] / row[counts[0]]:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if device == "cuda" and "native" in args.runners:
        report["graph_replay_ms"] = replay_ms(model, args.context, counts)
        print("graph replay only (ms):", {n: round(v, 3) for n, v in report["graph_replay_ms"].items()})
    (out / "forward_cost.json").write_text(json.dumps(report, indent=1))
    (out / "forward_cost.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in cost.items():
        ax.plot(counts, [row[n] for n in counts], marker="o", label=f"{name} runner")
    ax.set_xlabel("tokens in one forward")
    ax.set_ylabel("ms")
    ax.set_title(f"bfloat16 forward, {report['device']}, {args.context} cached tokens", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "forward_cost.png", dpi=110)


if __name__ == "__main__":
    main()
