"""``speculum train-draft``: train a learned draft head for a model by self-distillation.

Three stages, each resumable (an interrupted run picks up where it stopped, from files in ``out``):

1. prompts (:mod:`speculum.train.prompts`): the project's own set, plus questions the model writes
   itself; recorded in ``prompts.jsonl``;
2. data (:mod:`speculum.train.distill`): the model answers them, batched, keeping its features;
3. training (the kind's trainer, named in :data:`~speculum.heads.kinds.LEARNED`:
   :mod:`speculum.train.eagle`, :mod:`speculum.train.medusa` for ``medusa`` and ``hydra``,
   :mod:`speculum.train.clover`, :mod:`speculum.train.kangaroo`, :mod:`speculum.train.ppd`): the head, checkpointed; then
   ``<kind>.safetensors``, ``report.json`` and ``loss.png``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import SpeculumError
from ..heads.kinds import LEARNED


def trainable() -> tuple[str, ...]:
    """The learned kinds ``train-draft`` can train (those with a trainer)."""
    return tuple(k for k, spec in LEARNED.items() if spec.trainer is not None)


@dataclass
class DraftTraining:
    """What ``train-draft`` does (its command-line options)."""

    model: str = "default"
    kind: str = "eagle"
    out: str = "heads/default"
    prompts: int = 1600
    self_prompts: int = 160  # of them, written by the model itself
    max_new_tokens: int = 256
    batch: int = 16
    dtype: str = "auto"  # the model's dtype while it writes the data (the head trains in float32)
    epochs: int = 10
    vocab: int = 8192
    lr: float = 1e-3
    unroll: int = 2
    heads: int = 4  # medusa / hydra / clover: heads; ppd: prompt tokens (draft depths)
    exit_layer: int = 2  # kangaroo: the target layers its draft runs
    ensemble: int = 1  # ppd: embeddings per prompt position (EPT)
    max_samples: int = 0  # train on at most this many samples (0: all)
    layout: str = "speculum"  # eagle: "eagle1" for a head vLLM loads (speculum export-head)
    seed: int = 0

    @classmethod
    def for_kind(cls, kind: str, **options) -> DraftTraining:
        """The settings for ``kind``: ``options`` given as None take the kind's defaults (where its
        training departs from this class's: ``LearnedKind.train_defaults``)."""
        given = {k: v for k, v in options.items() if v is not None}
        spec = LEARNED.get(kind)
        return cls(kind=kind, **{**(spec.train_defaults if spec else {}), **given})


def _own_prompts(model, tok, n: int, seed: int, progress: bool) -> list[tuple[str, str]]:
    """``n`` prompts the model writes itself: its answers to :func:`question_requests`."""
    from ..prompts import encode_prompt
    from ..runners import runner_for
    from .distill import generate_batched
    from .prompts import question_requests

    asks = [encode_prompt(tok, q) for q in question_requests(n, seed)]
    runner = runner_for(model)
    out: list[str | None] = [None] * n
    if progress:
        print(f"speculum: asking the model for {n} prompts of its own", file=sys.stderr)

    def done(i, response, feats):
        text = tok.decode(response, skip_special_tokens=True).strip().split("\n")[0].strip().strip('"')
        out[i] = text if len(text) >= 12 else None

    generate_batched(runner, tok, asks, 48, (runner.num_layers,), batch=16, seed=seed, on_done=done)
    return [("self", t) for t in dict.fromkeys(x for x in out if x)]


DATA_FIELDS = ("model", "prompts", "self_prompts", "max_new_tokens", "dtype", "seed")


def _check_settings(path: Path, settings: dict, what: str) -> None:
    """Record ``settings`` in ``path``, refusing a directory that holds a run with other ones."""
    if path.exists() and json.loads(path.read_text()) != settings:
        raise SpeculumError(f"{path.parent} holds {what} made with other settings ({path}); choose another --out")
    path.write_text(json.dumps(settings, indent=1))


def train_config(job: DraftTraining):
    """The trainer's :class:`~speculum.train.trainer.TrainConfig` for ``job``: ``--heads`` sets the
    draft depth of the kinds with one head per depth (medusa, hydra, clover) and ppd's prompt tokens."""
    from .trainer import TrainConfig

    cfg = TrainConfig(epochs=job.epochs, lr=job.lr, vocab=job.vocab, unroll=job.unroll, seed=job.seed,
                      layout=job.layout)
    if job.kind in ("medusa", "hydra", "clover", "ppd"):
        cfg.num_heads = cfg.eval_depths = job.heads
    if job.kind == "kangaroo":
        cfg.exit_layer, cfg.eval_depths = job.exit_layer, 1
    if job.kind == "ppd":
        cfg.ensemble, cfg.vocab, cfg.max_len = job.ensemble, 0, 512
    return cfg


def train_draft(job: DraftTraining, progress: bool = True) -> dict:
    """Run the three stages; returns the final report's summary.

    Layout of ``job.out``: ``prompts.jsonl`` and ``data/`` (shared by every head kind trained there
    from the same data settings, ``data-settings.json``), then per kind ``<kind>/`` (settings,
    checkpoint, ``report.json``, ``loss.png``) and the head, ``<kind>.safetensors``."""
    import torch

    from ..loading import load
    from .distill import load_samples, self_distill
    from .prompts import training_prompts
    from .trainer import write_report

    if job.kind not in trainable():
        raise SpeculumError(f"train-draft --kind {job.kind}: only {', '.join(trainable())} can be trained so far")
    if job.prompts < 8 or job.max_new_tokens < 8 or job.epochs < 1 or job.batch < 1 or not 1 <= job.heads <= 8 \
            or not 1 <= job.ensemble <= 8 or job.exit_layer < 1:
        raise SpeculumError("train-draft needs --prompts >= 8, --max-new-tokens >= 8, --epochs >= 1, --batch >= 1, "
                            "--heads and --ensemble in 1..8 and --exit-layer >= 1")
    if job.layout not in ("speculum", "eagle1") or (job.layout != "speculum" and job.kind != "eagle"):
        raise SpeculumError("train-draft --layout: 'speculum' (default) or, for --kind eagle, 'eagle1'")
    out = Path(job.out).expanduser()
    run_dir = out / job.kind
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = asdict(job)
    if job.layout == "speculum":  # (runs from before the option: their settings stay the same)
        settings.pop("layout")
    _check_settings(out / "data-settings.json", {k: settings[k] for k in DATA_FIELDS}, "training data")
    _check_settings(run_dir / "settings.json", settings, f"a {job.kind} run")
    t0 = time.time()
    model, tok = load(job.model, job.dtype)
    prompts_file = out / "prompts.jsonl"
    if prompts_file.exists():
        prompts = [tuple(json.loads(line)) for line in prompts_file.read_text().splitlines()]
    else:
        own = _own_prompts(model, tok, job.self_prompts, job.seed, progress) if job.self_prompts else []
        prompts = training_prompts(job.prompts - len(own), job.seed) + own
        prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    shards = self_distill(model, tok, prompts, out / "data", job.max_new_tokens, batch=job.batch,
                          seed=job.seed, progress=progress)
    t_data = time.time() - t0
    samples = load_samples(shards)
    if job.max_samples:
        samples = samples[:job.max_samples]
    torch.manual_seed(job.seed)
    cfg = train_config(job)
    trainer = LEARNED[job.kind].trainer_class()(model, samples, run_dir, cfg, progress)
    trainer.run()
    t_all = time.time() - t0
    from ..heads import target_key

    meta = {"target": target_key(model), "model": job.model, "settings": settings,
            "data_seconds": round(t_data), "total_seconds": round(t_all),
            "tokens": sum(len(s.ids) - s.prompt_len for s in samples), "samples": len(samples)}
    head = trainer.save(out / f"{job.kind}.safetensors", meta)
    report, png = write_report(trainer.history, run_dir, {**meta, "coverage": trainer.coverage}, job.kind)
    return {**meta, "head": str(head), "report": str(report), "plot": str(png),
            "top1_by_depth": trainer.history.evals[-1]["top1"]}
