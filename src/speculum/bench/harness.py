"""The benchmark harness (in the spirit of Spec-Bench).

All methods run in one process on the same loaded model. After a warm-up run of every method,
prompts are visited in order and, for each prompt, every method runs once, in an order that
rotates from prompt to prompt, so that drift of the machine (thermal, other load) hits all
methods alike. Per-prompt records go to ``per_prompt.jsonl``; aggregates to ``results.json``.

Statistics per method, overall and per task:

- ``tok_s``: mean over prompts of new tokens / wall time (prefill included);
- ``speedup_vs_hf`` / ``speedup_vs_ar``: that mean divided by the reference method's mean;
- ``mean_accepted``: total new tokens / total target forward passes that produced tokens;
- ``identical_frac``: fraction of prompts whose output tokens equal ``ar``'s (per prompt:
  ``identical_to_ar``).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..methods import build_method
from ..models import dtype_name
from ..prompts import encode_prompt
from ..runners import runner_for
from ..sampling import SamplingParams
from ..weights import model_device
from .data import TASKS, Prompt

WARMUP_PROMPT = "List three colours of the rainbow."


@dataclass
class Record:
    method: str
    question_id: str
    task: str
    new_tokens: int
    forwards: int
    time_s: float
    tokens: list[int]
    draft_s: float = 0.0  # drafting time over the request's steps (engine methods)
    verify_s: float = 0.0  # verification forwards' time
    steps: int = 0  # engine steps (0 for transformers' methods)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0


def machine_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def versions() -> dict:
    import transformers

    from .. import __version__

    return {"speculum": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def run_benchmark(model, tokenizer, prompts: list[Prompt], methods: list[str], max_new_tokens: int = 128,
                  sampling: SamplingParams | None = None, chat: bool | None = None, draft_model=None,
                  draft_tokenizer=None, seed: int = 0, progress: bool = True,
                  method_options: dict[str, dict] | None = None) -> tuple[dict, list[Record]]:
    """Run ``methods`` on ``prompts`` interleaved; return ``(results, records)``.

    ``results`` has the layout of ``results.json`` (see module docstring).
    """
    sampling = sampling or SamplingParams()
    method_options = method_options or {}
    runner = runner_for(model)
    built = {m: build_method(m, model, tokenizer, draft_model, draft_tokenizer, runner=runner,
                             **method_options.get(m, {}))
             for m in methods}
    encoded = [encode_prompt(tokenizer, p.text, chat) for p in prompts]

    # warm-up: every method once on a prompt outside the data (allocator, kernels, caches), so
    # that no cross-request drafter state (suffix cache, recycling matrix) has seen a benchmark answer
    warm = encode_prompt(tokenizer, WARMUP_PROMPT, chat)
    for m in methods:
        built[m].run(warm, min(16, max_new_tokens), sampling, seed=seed)

    records: list[Record] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", disable=not progress)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in order:
            bar.set_postfix_str(f"{prompt.task}:{m}")
            r = built[m].run(ids, max_new_tokens, sampling, seed=seed + i)
            records.append(Record(m, prompt.question_id, prompt.task, r.new_tokens, r.forwards, r.time_s,
                                  r.tokens, sum(s.draft_s for s in r.steps), sum(s.verify_s for s in r.steps),
                                  len(r.steps)))
            bar.update()
    bar.close()
    return summarize(records, methods), records


def _stats(recs: list[Record], ref_mean: dict[str, float | None], ar_tokens: dict[str, list[int]] | None) -> dict:
    tok_s = sum(r.tok_s for r in recs) / len(recs)
    forwards = sum(r.forwards for r in recs)
    out = {
        "tok_s": round(tok_s, 3),
        "speedup_vs_hf": round(tok_s / ref_mean["hf"], 4) if ref_mean.get("hf") else None,
        "speedup_vs_ar": round(tok_s / ref_mean["ar"], 4) if ref_mean.get("ar") else None,
        "mean_accepted": round(sum(r.new_tokens for r in recs) / forwards, 4) if forwards else None,
        "identical_frac": None,
        "prompts": len(recs),
    }
    steps = sum(r.steps for r in recs)
    if steps:  # engine methods: where a step's time goes
        out["draft_ms_per_step"] = round(1000 * sum(r.draft_s for r in recs) / steps, 3)
        out["verify_ms_per_step"] = round(1000 * sum(r.verify_s for r in recs) / steps, 3)
    if ar_tokens is not None:
        same = [r.tokens == ar_tokens[r.question_id] for r in recs if r.question_id in ar_tokens]
        out["identical_frac"] = round(sum(same) / len(same), 4) if same else None
    return out


def summarize(records: list[Record], methods: list[str]) -> dict:
    """Aggregate per-prompt records into ``{"methods": {NAME: {"overall": ..., "by_task": {...}}}}``."""
    def mean_tok_s(method: str, task: str | None) -> float | None:
        rs = [r for r in records if r.method == method and (task is None or r.task == task)]
        return sum(r.tok_s for r in rs) / len(rs) if rs else None

    ar_tokens = {r.question_id: r.tokens for r in records if r.method == "ar"} if "ar" in methods else None
    tasks = [t for t in TASKS if any(r.task == t for r in records)]
    tasks += sorted({r.task for r in records} - set(tasks))
    out: dict = {"methods": {}}
    for m in methods:
        mine = [r for r in records if r.method == m]
        if not mine:
            continue
        entry = {"overall": _stats(mine, {ref: mean_tok_s(ref, None) for ref in ("hf", "ar")}, ar_tokens),
                 "by_task": {}}
        for t in tasks:
            rs = [r for r in mine if r.task == t]
            if rs:
                entry["by_task"][t] = _stats(rs, {ref: mean_tok_s(ref, t) for ref in ("hf", "ar")}, ar_tokens)
        out["methods"][m] = entry
    return out


def write_outputs(out_dir: str | Path, results: dict, records: list[Record], meta: dict) -> Path:
    """Write ``results.json``, ``results.md``, ``speedup.png`` and ``per_prompt.jsonl`` into ``out_dir``."""
    from .report import markdown_table, speedup_plot, write_files

    full = {**meta, **results}
    ar_tokens = {r.question_id: r.tokens for r in records if r.method == "ar"}
    per_prompt = [{"method": r.method, "question_id": r.question_id, "task": r.task, "new_tokens": r.new_tokens,
                   "forwards": r.forwards, "time_s": round(r.time_s, 4), "tok_s": round(r.tok_s, 3),
                   "identical_to_ar": r.tokens == ar_tokens[r.question_id] if r.question_id in ar_tokens else None}
                  for r in records]
    out = write_files(out_dir, {"results.json": json.dumps(full, indent=2), "results.md": markdown_table(full),
                                "per_prompt.jsonl": "".join(json.dumps(row) + "\n" for row in per_prompt)})
    speedup_plot(full, out / "speedup.png")
    return out


def bench_meta(model, args: dict) -> dict:
    """What a report says about the run: model, dtype (the weights', so ``auto`` shows what it chose),
    machine, versions, settings and date."""
    return {
        "model": getattr(model, "speculum_name", model.config.name_or_path),
        "dtype": dtype_name(next(model.parameters()).dtype),
        "weights": getattr(model, "speculum_weights", "float"),
        "machine": machine_info(model_device(model)),
        "versions": versions(),
        "settings": args,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
