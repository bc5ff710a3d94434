"""PEARL (pre- and post-verify: the draft drafts in a thread while the target verifies) against
sequential drafting with the same draft model, on this CPU.

The target is the packaged SmolLM2-135M-Instruct in float32, or with ``--weights gguf`` on its GGUF
weights through speculum's kernels (torch's operators and the kernels both release the GIL, so the
draft's thread runs beside the target's forward). The draft is the target's first ``--layers`` layers
(on the same weights) with its final norm and LM head (no training), or ``--draft-model``. Methods, run interleaved per prompt after one warm-up generation:

- ``ar``: plain decoding (the reference for the ratio).
- ``sequential``: the same drafter with ``post_verify=False`` (same chunk length rule), at
  ``--seq-threads`` torch threads (default 2: sequential drafting may use both cores for each forward).
- ``draft_model``: speculum's ``draft_model`` method with the same draft (its own length rule).
- ``pearl``: PEARL (pre- and post-verify), adaptive length, at ``--threads`` torch threads (default 1:
  one core for the target, one for the draft).
- ``pearl_post``: PEARL with post-verify only (``pre_verify=False``: a chunk drafted after a rejection
  is drafted whole in the foreground), same threads.

Greedy, float32: every method's output is checked equal to ``ar``'s. Prints tok/s per method
(new tokens over decode time), how many of PEARL's chunks came ready from the draft's thread, and the
ratios pearl / sequential and pearl_post / sequential.

    OMP_NUM_THREADS=2 PYTHONPATH=src python benchmarks/pearl_vs_sequential.py --prompts 3 --new 48

(about 2-4 minutes on an idle 2-core CPU, most of it loading and the warm-up.)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from speculum import load
from speculum.bench.data import load_prompts
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.drafters.pearl import PearlDrafter
from speculum.engine import Engine
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

DATA = Path("/work/shared/data/spec_bench/question_dev.jsonl")


def first_layers(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A copy of ``model`` with only its first ``layers`` decoder layers (its final norm and head kept)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3, help="Spec-Bench dev prompts, one per task in turn")
    ap.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--layers", type=int, default=10, help="the draft: the target's first LAYERS layers")
    ap.add_argument("--draft-model", help="a draft model to load instead (same tokenizer)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while pearl runs")
    ap.add_argument("--seq-threads", type=int, default=2, help="torch threads while ar / sequential run")
    ap.add_argument("--gamma", type=int, default=None, help="fixed chunk length (default: adaptive)")
    ap.add_argument("--weights", choices=["float", "gguf"], default="float",
                    help="the target's weights, and the first-layers draft's: float32 (default) or the GGUF "
                         "weights kept quantized")
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args()

    model, tok = load("default", dtype="float32", weights=args.weights)
    draft = load(args.draft_model, dtype="float32", weights="float")[0] if args.draft_model \
        else first_layers(model, args.layers)
    runner = runner_for(model)
    prompts = load_prompts(args.data, per_task=1)[:args.prompts]
    ids = [encode_prompt(tok, p.text) for p in prompts]

    pearl = PearlDrafter(draft, gamma=args.gamma)
    methods = {
        "ar": (Engine(runner, AutoregressiveDrafter(), tok), args.seq_threads),
        "sequential": (Engine(runner, PearlDrafter(draft, gamma=args.gamma, post_verify=False), tok),
                       args.seq_threads),
        "draft_model": (Engine(runner, DraftModelDrafter(draft), tok), args.seq_threads),
        "pearl": (Engine(runner, pearl, tok), args.threads),
        "pearl_post": (Engine(runner, PearlDrafter(draft, gamma=args.gamma, pre_verify=False), tok), args.threads),
    }
    for engine, threads in methods.values():  # warm-up
        torch.set_num_threads(threads)
        engine.generate(ids[0], 8)
    for engine, _ in methods.values():
        if isinstance(engine.drafter, PearlDrafter):
            engine.drafter.hits = engine.drafter.misses = 0
    rates: dict[str, list[float]] = {m: [] for m in methods}
    accepted: dict[str, list[float]] = {m: [] for m in methods}
    for p, prompt in zip(prompts, ids):
        want = None
        for name, (engine, threads) in methods.items():
            torch.set_num_threads(threads)
            t = time.perf_counter()
            result = engine.generate(prompt, args.new)
            decode_s = time.perf_counter() - t - result.prefill_s
            want = want if want is not None else result.tokens
            status = "" if result.tokens == want else "  OUTPUT DIFFERS FROM ar"
            rates[name].append(len(result.tokens) / decode_s)
            accepted[name].append(result.mean_accepted)
            print(f"{p.task:>14} {name:>12}: {rates[name][-1]:6.1f} tok/s, {result.mean_accepted:.2f} "
                  f"tokens/step{status}", flush=True)
    print()
    for name in methods:
        print(f"{name:>12}: {statistics.mean(rates[name]):6.1f} tok/s (mean over prompts), "
              f"{statistics.mean(accepted[name]):.2f} tokens per step")
    for name in ("pearl", "pearl_post"):
        ratio = statistics.mean(a / b for a, b in zip(rates[name], rates["sequential"]))
        drafter = methods[name][0].drafter
        print(f"{name} / sequential: {ratio:.2f}x; {name} / ar: "
              f"{statistics.mean(a / b for a, b in zip(rates[name], rates['ar'])):.2f}x; "
              f"chunks ready from the draft's thread {drafter.hits}, not {drafter.misses}")


if __name__ == "__main__":
    main()
