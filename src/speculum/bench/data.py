"""Benchmark prompts in Spec-Bench's JSONL format.

Each line: ``{"question_id": ..., "category": ..., "turns": [first user turn, ...]}``. Only the first
turn is used. Categories map to Spec-Bench's six tasks: every MT-bench category (writing,
roleplay, reasoning, math, coding, extraction, stem, humanities) is ``mt_bench``; translation,
summarization, qa, math_reasoning and rag are their own tasks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ..errors import SpeculumError

TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass
class Prompt:
    question_id: str
    task: str
    category: str
    text: str


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def read_jsonl(path: str | Path, what: str, items: str, make, bad: str) -> list:
    """``make(row, line number)`` for each non-blank line of the JSONL file ``path``; a
    :class:`SpeculumError` for a missing ``what`` file, a line that is not a row (``bad``, formatted
    with the error as ``e``) or a file without ``items``."""
    path = Path(path)
    if not path.is_file():
        raise SpeculumError(f"{what} {path} does not exist")
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(make(json.loads(line), lineno))
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    raise SpeculumError(f"{path}:{lineno}: {bad.format(e=e)}") from None
    if not out:
        raise SpeculumError(f"{path} holds no {items}")
    return out


def demo_prompts_path() -> Path:
    """The small bundled prompt set (two per task) that ``make demo`` runs."""
    return Path(str(files("speculum.bench").joinpath("demo_prompts.jsonl")))


def load_prompts(path: str | Path, per_task: int | None = None) -> list[Prompt]:
    """Read Spec-Bench-format prompts; ``per_task=N`` keeps the first N of each task.

    For ``mt_bench`` the N are spread over its categories (round robin in file order), so a
    small N still mixes writing, reasoning, coding, ...
    """
    def prompt(row: dict, lineno: int) -> Prompt:
        category = row["category"]
        return Prompt(str(row.get("question_id", lineno)), task_of(category), category, row["turns"][0])

    prompts = read_jsonl(path, "benchmark data", "prompts", prompt,
                         "not a Spec-Bench record (needs category and turns)")
    if per_task is None:
        return prompts
    if per_task < 1:
        raise SpeculumError("--per-task must be at least 1")
    chosen: list[Prompt] = []
    for task in dict.fromkeys(p.task for p in prompts):
        of_task = [p for p in prompts if p.task == task]
        by_cat: dict[str, list[Prompt]] = {}
        for p in of_task:
            by_cat.setdefault(p.category, []).append(p)
        picked: list[Prompt] = []
        while len(picked) < per_task and any(by_cat.values()):
            for queue in by_cat.values():
                if queue and len(picked) < per_task:
                    picked.append(queue.pop(0))
        chosen.extend(picked)
    return chosen


def repeated_prompts_path() -> Path:
    """The bundled repeated workload: code-editing requests on one module and agent-style requests."""
    return Path(str(files("speculum.bench") / "repeated_prompts.jsonl"))


def repeated_workload(prompts: list[Prompt], rounds: int) -> list[Prompt]:
    """``prompts`` replayed ``rounds`` times, as in agent loops and editing sessions.

    Round ``r`` is the task ``round{r}``, so every report breaks results down by round; question ids
    get ``@r{r}`` so each replay is its own record.
    """
    if rounds < 1:
        raise SpeculumError("--rounds must be at least 1")
    return [Prompt(f"{p.question_id}@r{r}", f"round{r}", p.category, p.text)
            for r in range(1, rounds + 1) for p in prompts]
