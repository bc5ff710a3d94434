"""Benchmark reports: a Markdown table and a bar plot of speedup by task."""

from __future__ import annotations

from pathlib import Path

from ..figures import save, subplots


def write_files(out_dir: str | Path, files: dict[str, str]) -> Path:
    """``out_dir`` (made if missing) with each text of ``files`` written to its name there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    return out


def fmt(x, digits=2, suffix=""):
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _by_task(methods: dict) -> tuple[str, list[str], dict[str, list[dict | None]]]:
    """The reference speedup's key, the tasks (then ``overall``) and per method each one's statistics
    (None where the method has none)."""
    ref = "speedup_vs_hf" if "hf" in methods else "speedup_vs_ar"
    tasks = list(dict.fromkeys(t for e in methods.values() for t in e["by_task"])) + ["overall"]
    return ref, tasks, {name: [e["by_task"].get(t) if t != "overall" else e["overall"] for t in tasks]
                        for name, e in methods.items()}


def markdown_table(results: dict) -> str:
    """Overall table (one row per method) followed by a per-task speedup table."""
    methods = results["methods"]
    lines = [
        (f"Model `{results.get('model')}`, dtype {results.get('dtype')}, "
        f"{results.get('machine', {}).get('processor', '')} ({results.get('machine', {}).get('device', '')})."),
        "",
        ("| method | tok/s | speedup vs hf | speedup vs ar | mean accepted | draft ms/step | verify ms/step "
         "| identical to ar |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in methods.items():
        o = entry["overall"]
        lines.append(f"| {name} | {fmt(o['tok_s'], 1)} | {fmt(o['speedup_vs_hf'], 2, 'x')} | "
                     f"{fmt(o['speedup_vs_ar'], 2, 'x')} | {fmt(o['mean_accepted'])} | "
                     f"{fmt(o.get('draft_ms_per_step'), 1)} | {fmt(o.get('verify_ms_per_step'), 1)} | "
                     f"{fmt(o['identical_frac'])} |")
    ref, tasks, stats = _by_task(methods)
    lines += ["", f"{ref.replace('_', ' ')} by task (mean accepted tokens per step in brackets):", "",
              "| method | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for name, row in stats.items():
        cells = ["–" if s is None else f"{fmt(s[ref], 2, 'x')} ({fmt(s['mean_accepted'])})" for s in row]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def speedup_plot(results: dict, path: str | Path) -> None:
    """Grouped bars: one group per task (and overall), one bar per method."""
    methods = results["methods"]
    ref, tasks, stats = _by_task(methods)
    fig, ax = subplots(figsize=(max(6.0, 1.3 * len(tasks) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for j, (name, row) in enumerate(stats.items()):
        vals = [(s or {}).get(ref) or 0.0 for s in row]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        ax.bar(xs, vals, width, label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), tasks, rotation=20)
    ax.set(ylabel=ref.replace("_", " "), title=f"{results.get('model')} ({results.get('dtype')})")
    ax.legend(fontsize=8, ncols=min(4, len(methods)))
    save(fig, path)
