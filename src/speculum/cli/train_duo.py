"""``speculum train-duo``: DuoAttention's per-head gates learned for a model (:mod:`speculum.train.duo_gates`)."""

from __future__ import annotations

from dataclasses import fields


def add_parser(sub) -> None:
    from ..train.duo_gates import GateTraining

    t = sub.add_parser(
        "train-duo", help="learn DuoAttention's per-head gates for a model (the duo KV policy)",
        description="Learn which KV heads of --model need the whole context (retrieval heads) and which need only "
                    "attention sinks and a recent window (streaming heads), DuoAttention's way: with the model's "
                    "weights frozen (float32), each head mixes full and streaming attention by a gate, and the "
                    "gates learn to keep the final hidden states on synthetic passkey retrieval while an L1 "
                    "penalty pulls them down. Writes a gates file for --kv-policy duo:gates=OUT.")
    t.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    t.add_argument("--out", required=True, help="the gates file to write (JSON)")
    defaults = GateTraining()
    helps = {"steps": "optimiser steps", "samples": "distinct passkey samples, cycled over the steps",
             "min_length": "shortest sample in tokens", "max_length": "longest sample in tokens",
             "passkeys": "passkeys per sample", "passkey_words": "words per passkey",
             "sinks": "attention sinks of a streaming head", "window": "recent window of a streaming head",
             "lr": "peak learning rate", "reg": "weight of the L1 penalty on the gates", "seed": "data seed"}
    for f in fields(GateTraining):
        value = getattr(defaults, f.name)
        t.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value,
                       help=f"{helps[f.name]} (default: %(default)s)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=None)


def run(args) -> int:
    from pathlib import Path

    from ..train.duo_gates import GateTraining, learn_gates

    cfg = GateTraining(**{f.name: getattr(args, f.name) for f in fields(GateTraining)})
    summary = learn_gates(args.model, Path(args.out), cfg, progress=not args.no_progress)
    at_half = summary["distill_at_sparsity_0.5"]
    print(f"wrote {summary['gates']} ({summary['seconds']} s); distillation loss with half the heads streaming: "
          f"{at_half['learned']} (the lowest gates), {at_half['reversed']} (the highest), {at_half['all_streaming']} "
          f"with all of them; use it with --kv-policy duo:gates={summary['gates']}")
    return 0
