"""``speculum longctx``: KV policies on the RULER-style suite (:mod:`speculum.bench.ruler`).

For every length, every sample is run under every (policy, budget) in turn (``full`` first), so
the methods see the machine in the same state. Per run it records the score
(``string_match_all``), the most bytes the KV cache held, the process's peak resident memory
during that run (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; Linux only),
prefill time and decode tokens per second. Before each run freed memory is returned to the
system (glibc keeps it otherwise), so each run's peak is its own.

Two protocols: ``aware`` (the policy sees the whole prompt, question included, at prefill: how
SnapKV's paper and decode-time selection work) and ``agnostic`` (the context is compressed
before the question is appended: kvpress's default, the case of many questions over one
document).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections import defaultdict
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..drafters.ar import AutoregressiveDrafter
from ..drafters.kv_draft import KVDraftDrafter, kv_draft_options
from ..engine import Engine
from ..errors import SpeculumError
from ..figures import save, subplots
from ..kv import Budget, make_policy
from ..process_memory import return_freed_memory
from ..prompts import has_chat_template
from ..runners import runner_for, under_policy
from .report import write_files
from .ruler import TASKS, LongTask, make_task, string_match_all

PROTOCOLS = ("aware", "agnostic")
VALUE_KINDS = ("number", "word", "uuid")
# oneDNN keeps the kernels it compiled for every input shape it has met, up to 1024; each prompt
# length of the suite leaves a few behind (BENCHMARKS.md: resident memory grows over a suite without
# a cap). A policy run uses a handful of shapes (one token, a prefill chunk), so 16 costs no time.
ONEDNN_CACHE = 16


@dataclass
class Suite:
    """What ``speculum longctx`` runs, checked: lengths, tasks, policies (``full`` first), budgets,
    samples per (length, task) and needle value kinds."""

    lengths: list[int]
    tasks: list[str]
    policies: list[str]
    budgets: list[str]
    samples: int
    values: list[str]

    @classmethod
    def parse(cls, lengths: str, tasks: str, policies: str, budgets: str, samples: int, values: str) -> Suite:
        """From the command line's comma-separated lists; :class:`SpeculumError` on any mistake."""
        split = lambda text: [x.strip() for x in text.split(",") if x.strip()]
        try:
            lens = [int(x) for x in split(lengths)]
        except ValueError:
            raise SpeculumError("--lengths takes comma-separated token counts, e.g. 1024,2048") from None
        if not lens or min(lens) < 256:
            raise SpeculumError("--lengths: give lengths of at least 256 tokens")
        task_list, policy_list, budget_list = split(tasks), split(policies), split(budgets)
        if unknown := [t for t in task_list if t not in TASKS]:
            raise SpeculumError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if not task_list or not policy_list or not budget_list:
            raise SpeculumError("--tasks, --policies and --budget must not be empty")
        if samples < 1:
            raise SpeculumError("--samples must be at least 1")
        value_list = split(values)
        if not value_list or any(v not in VALUE_KINDS for v in value_list):
            raise SpeculumError(f"--values takes {', '.join(VALUE_KINDS)}, comma-separated")
        for b in budget_list:
            Budget.parse(b)
        for p in policy_list:
            make_policy(p, budget_list[0])
        if "full" in policy_list:  # the baseline runs first
            policy_list = ["full"] + [p for p in policy_list if p != "full"]
        return cls(lens, task_list, policy_list, budget_list, samples, value_list)


@dataclass
class LongRecord:
    policy: str
    budget: str
    length: int
    task: str
    seed: int
    value_kind: str
    prompt_tokens: int
    accuracy: float
    kv_bytes: int
    peak_rss_bytes: int | None
    rss_start_bytes: int | None  # resident memory when the run began (after the peak was reset)
    prefill_s: float
    decode_tok_s: float
    output: str
    time_s: float = 0.0  # prefill + decode, wall


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux ``clear_refs``; elsewhere nothing)."""
    return_freed_memory()
    with suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss(field: str = "VmHWM") -> int | None:
    """``VmHWM`` (peak) or ``VmRSS`` (current) resident memory of this process in bytes (None off Linux)."""
    with suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def encode_task(tokenizer, t: LongTask, chat: bool | None = None) -> tuple[list[int], int]:
    """Prompt ids (context, question, answer prefix) and the index where the question starts."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": t.context + "\n\n" + t.question}],
                                             add_generation_prompt=True, tokenize=False) + t.answer_prefix
        head, _, tail = text.partition("\n\n" + t.question)
        tail = "\n\n" + t.question + tail
        first = tokenizer(head, add_special_tokens=False)["input_ids"]
    else:
        head, tail = t.context, "\n\n" + t.question + "\n" + t.answer_prefix
        first = tokenizer(head)["input_ids"]
    return first + tokenizer(tail, add_special_tokens=False)["input_ids"], len(first)


def run_longctx(model, tokenizer, suite: Suite, protocol: str = "aware", chat: bool | None = None,
                progress: bool = True, kv_drafts: tuple[str, ...] = (), reproducible: bool = False) -> list[LongRecord]:
    """Run the suite; returns one record per (sample, policy, budget).
    ``kv_drafts``: lossless rows, the full cache verifying drafts from a compressed view
    (:mod:`speculum.drafters.kv_draft`; ``"streaming:window=256,bits=4"``), each named ``kv_draft:SPEC``.
    ``reproducible``: ``full`` and the kv-draft rows run in the reproducible mode (chains verified with
    numerics that do not depend on a step's row count, :meth:`NativeRunner.invariant`), so that their
    bfloat16 outputs can be compared token for token; the lossy policies run as usual."""
    if protocol not in PROTOCOLS:
        raise SpeculumError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    runner = runner_for(model)
    max_pos = runner.max_positions
    budget_free = lambda spec: getattr(make_policy(spec), "uses_budget", False) is False  # full, the quantizers
    configs = [(spec, b) for spec in suite.policies for b in (["-"] if budget_free(spec) else suite.budgets)]
    if reproducible and not hasattr(runner, "invariant"):
        raise SpeculumError("the reproducible mode needs the native runner")
    exact = runner.invariant() if reproducible else runner
    engines = {}
    for spec, budget in configs:
        policy = make_policy(spec, budget if budget != "-" else "1.0")
        engines[spec, budget] = (Engine(exact, AutoregressiveDrafter(), tokenizer, chains_only=reproducible)
                                 if policy is None else Engine(under_policy(runner, policy), AutoregressiveDrafter(), tokenizer))
    for spec in kv_drafts:
        configs.append((f"kv_draft:{spec}", "-"))
        engines[configs[-1]] = Engine(exact, KVDraftDrafter(model, **kv_draft_options(spec)), tokenizer,
                                      chains_only=reproducible)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    records: list[LongRecord] = []
    work = [(length, task, seed) for length in suite.lengths for task in suite.tasks for seed in range(suite.samples)]
    bar = tqdm(total=len(work) * len(configs), desc="longctx", unit="run", disable=not progress)
    warm = False
    for length, task, seed in work:
        # at the model's limit, room for the answer
        t = make_task(task, min(length, max_pos - 128), seed, count, tuple(suite.values))
        ids, query_start = encode_task(tokenizer, t, chat)
        if len(ids) + t.max_new_tokens >= max_pos:
            raise SpeculumError(f"a {len(ids)}-token prompt does not fit the model's context ({max_pos})")
        if not warm:  # a short untimed run of every configuration first: kernels and code paths warm
            for engine in engines.values():
                engine.generate(ids[-300:], 4)
            warm = True
        for spec, budget in configs:
            engine = engines[spec, budget]
            gc.collect()
            reset_peak_rss()
            start = peak_rss("VmRSS")
            r = engine.generate(ids, t.max_new_tokens,
                                query_start=query_start if protocol == "agnostic" else None)
            rss = peak_rss()
            decode_s = r.time_s - r.prefill_s
            records.append(LongRecord(spec, budget, length, task, seed, t.meta["kind"], len(ids), string_match_all(r.text, t.expected),
                                      r.kv_bytes, rss, start, round(r.prefill_s, 3),
                                      round(r.new_tokens / decode_s, 3) if decode_s > 0 else 0.0, r.text,
                                      round(r.time_s, 3)))
            bar.update(1)
    bar.close()
    return records


def summarize(records: list[LongRecord]) -> list[dict]:
    """Rows of the issue's table: mean over samples per (policy, budget, length, task), plus an
    ``all`` task row per (policy, budget, length)."""
    groups: dict[tuple, list[LongRecord]] = defaultdict(list)
    full_out = {(r.length, r.task, r.seed, r.value_kind): r.output for r in records if r.policy == "full"}
    for r in records:
        groups[r.policy, r.budget, r.length, r.task].append(r)
        groups[r.policy, r.budget, r.length, "all"].append(r)
    rows = []
    for (policy, budget, length, task), rs in groups.items():
        rss = [r.peak_rss_bytes for r in rs if r.peak_rss_bytes is not None]
        rise = [r.peak_rss_bytes - r.rss_start_bytes for r in rs
                if r.peak_rss_bytes is not None and r.rss_start_bytes is not None]
        rows.append({
            "policy": policy, "budget": budget, "length": length, "task": task, "samples": len(rs),
            "accuracy": round(100 * statistics.mean(r.accuracy for r in rs), 1),
            "kv_bytes": int(statistics.mean(r.kv_bytes for r in rs)),
            "peak_rss_bytes": max(rss) if rss else None,
            "peak_rss_rise_bytes": max(rise) if rise else None,  # above the resident memory at the start
            "decode_tok_s": round(statistics.mean(r.decode_tok_s for r in rs), 2),
            "prefill_s": round(statistics.mean(r.prefill_s for r in rs), 2),
            "time_s": round(statistics.mean(r.time_s for r in rs), 2),
            # outputs identical to the full cache's, in % (None without a full run)
            "same_as_full": (round(100 * statistics.mean(
                r.output == full_out[r.length, r.task, r.seed, r.value_kind] for r in rs), 1)
                if all((r.length, r.task, r.seed, r.value_kind) in full_out for r in rs) else None),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """Accuracy x policy x budget x length, with memory and speed; ratios against ``full`` at each length."""
    lengths = sorted({r["length"] for r in rows})
    tasks = sorted({r["task"] for r in rows} - {"all"})
    out = []
    for length in lengths:
        here = [r for r in rows if r["length"] == length]
        full = next((r for r in here if r["policy"] == "full" and r["task"] == "all"), None)
        out.append(f"### {length} tokens\n")
        out.append("| policy | budget | " + " | ".join(tasks) + " | all | KV MiB | KV vs full | peak RSS MiB | "
                   "peak rise MiB | decode tok/s | vs full | prefill s | = full % |")
        out.append("|---|---|" + "---:|" * (len(tasks) + 9))
        for r in [r for r in here if r["task"] == "all"]:
            acc = {x["task"]: x["accuracy"] for x in here if (x["policy"], x["budget"]) == (r["policy"], r["budget"])}
            kv_ratio = f"{r['kv_bytes'] / full['kv_bytes']:.0%}" if full and full["kv_bytes"] else "-"
            speed = f"{r['decode_tok_s'] / full['decode_tok_s']:.2f}x" if full and full["decode_tok_s"] else "-"
            rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" if r["peak_rss_bytes"] else "-"
            rise = f"{r['peak_rss_rise_bytes'] / 2**20:.0f}" if r.get("peak_rss_rise_bytes") is not None else "-"
            out.append(f"| {r['policy']} | {r['budget']} | " + " | ".join(f"{acc.get(t, float('nan')):.0f}" for t in tasks)
                       + f" | {r['accuracy']:.1f} | {r['kv_bytes'] / 2**20:.1f} | {kv_ratio} | {rss} | {rise} | "
                       f"{r['decode_tok_s']:.1f} | {speed} | {r['prefill_s']:.1f} | "
                       f"{'-' if r.get('same_as_full') is None else format(r['same_as_full'], '.0f')} |")
        out.append("")
    return "\n".join(out)


def budget_fraction(row: dict, full_bytes: int | None) -> float:
    """A row's KV budget as a fraction of the context: tokens kept (eviction) or read per step
    (tidal, quest, shadowkv); bytes held against the full cache for budget-free policies (full, the quantizers)."""
    budget = row["budget"]
    if budget == "-":
        return row["kv_bytes"] / full_bytes if full_bytes else 1.0
    x = float(budget)
    return x if x <= 1 else min(1.0, x / row["length"])


def accuracy_plot(rows: list[dict], path: str | Path) -> None:
    """Accuracy (all tasks) against the KV budget, one line per policy, one panel per length."""
    lengths = sorted({r["length"] for r in rows})
    many = len({r["policy"] for r in rows}) > 10  # the legend then goes beside the panels, in columns
    fig, axes = subplots(1, len(lengths), figsize=(4.8 * len(lengths) + (3.2 if many else 0), 4.6 if many else 3.8),
                         squeeze=False)
    for ax, length in zip(axes[0], lengths):
        here = [r for r in rows if r["length"] == length and r["task"] == "all"]
        full = next((r for r in here if r["policy"] == "full"), None)
        full_bytes = full["kv_bytes"] if full else None
        for i, policy in enumerate(sorted({r["policy"] for r in here})):
            pts = sorted((budget_fraction(r, full_bytes), r["accuracy"]) for r in here if r["policy"] == policy)
            # markers and dashes cycle so that policies on the same points stay told apart
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vDP*X"[i % 8], ms=7 - (i % 4),
                    linestyle=("-", "--", ":", "-.")[i % 4], label=policy, alpha=0.8)
        ax.set(title=f"{length} tokens", xlabel="KV budget (fraction of context kept, read, or of full bytes)",
               ylabel="accuracy (%)", ylim=(-5, 105))
        ax.grid(alpha=0.3)
    if many:
        axes[0][-1].legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        axes[0][-1].legend(fontsize=8)
    save(fig, path)


def write_outputs(out_dir: str | Path, records: list[LongRecord], meta: dict) -> list[dict]:
    """``results.json`` (rows with the issue's fields, plus per-run records and run metadata),
    ``results.md`` and ``accuracy.png`` in ``out_dir``; returns the rows."""
    rows = summarize(records)
    out = write_files(out_dir, {
        "results.json": json.dumps(rows, indent=1),
        "records.json": json.dumps({"meta": meta, "records": [asdict(r) for r in records]}, indent=1),
        "results.md": f"# speculum longctx ({time.strftime('%Y-%m-%d')})\n\n`{meta.get('command', '')}`\n\n"
                      + markdown(rows)})
    accuracy_plot(rows, out / "accuracy.png")
    return rows
