"""StreamingLLM past the context: one request generates several times the model's context length.

The ``streaming`` KV policy numbers positions inside its cache (attention sinks + a recent
window), so the positions the model sees stay below the cache size however long the text grows.
This script generates ``--factor`` x the model's context in one request (sampled, fixed seed) and
records, per segment of ``--segment`` tokens:

- decode tok/s and the process's resident memory (``VmRSS``): memory must stay flat;
- the KV cache's bytes (the policy's budget plus its eviction slack);
- coherence: the perplexity of the segment under the same model reading it fresh, with the
  preceding segment as context (full attention, positions from 0). Text that stays on topic and
  grammatical keeps a perplexity like that of the first segment; a model fed positions it was not
  trained on degenerates and the perplexity climbs (or collapses into one repeated token, which
  ``distinct`` shows).

Usage (the numbers in BENCHMARKS.md come from this command)::

    .venv/bin/python benchmarks/streaming_long.py --factor 3 --budget 1024 --out docs/streaming-3x
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import speculum
from speculum.drafters import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.kv import make_policy
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

PROMPT = ("Write a very long adventure story about a group of travellers crossing a continent: the towns, the "
          "people they meet, the weather, the food, their quarrels and their discoveries. Keep going.")


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@torch.inference_mode()
def perplexity(model, context: list[int], segment: list[int]) -> float:
    """exp(mean NLL) of ``segment`` after ``context``, by one plain forward of the model."""
    ids = torch.tensor([context + segment])
    logits = model(ids).logits[0, len(context) - 1:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(segment))
    return math.exp(nll.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--factor", type=float, default=3.0, help="tokens to generate, in model contexts")
    ap.add_argument("--budget", default="1024", help="the streaming policy's cache budget (tokens)")
    ap.add_argument("--segment", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="streaming-out")
    args = ap.parse_args()

    model, tok = speculum.load(args.model, dtype=args.dtype)
    runner = runner_for(model)
    context = runner.max_positions
    new = int(args.factor * context)
    engine = Engine(runner, AutoregressiveDrafter(), tok, eos_token_ids=[], kv_policy=make_policy("streaming",
                                                                                                 args.budget))
    ids = encode_prompt(tok, PROMPT)
    sampling = speculum.SamplingParams(args.temperature, 0, args.top_p)
    out: list[int] = []
    segments = []
    t0 = last = time.perf_counter()
    stream = engine.stream(ids, new, sampling, seed=args.seed)
    while True:
        try:
            out.extend(next(stream))
        except StopIteration as done:
            result = done.value
            break
        while len(out) >= (len(segments) + 1) * args.segment:
            now = time.perf_counter()
            segments.append({"end_token": (len(segments) + 1) * args.segment, "tok_s": args.segment / (now - last),
                             "rss_mib": round(rss_mib(), 1)})
            last = now
            print(segments[-1], flush=True)
    seg = args.segment
    for i, s in enumerate(segments):
        piece = out[i * seg:(i + 1) * seg]
        before = (ids + out)[max(0, len(ids) + i * seg - seg):len(ids) + i * seg]
        s["perplexity"] = round(perplexity(model, before, piece), 2)
        s["distinct"] = round(len(set(piece)) / len(piece), 3)
    report = {"model": args.model, "dtype": args.dtype, "context": context, "generated": result.new_tokens,
              "finish_reason": result.finish_reason, "budget": args.budget, "kv_bytes_peak": result.kv_bytes,
              "time_s": round(time.perf_counter() - t0, 1), "tok_s": round(result.tok_s, 2), "segments": segments,
              "text_start": tok.decode(out[:200]), "text_middle": tok.decode(out[len(out) // 2:len(out) // 2 + 200]),
              "text_end": tok.decode(out[-200:])}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in report.items() if k != "segments"}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
