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


def _fmt(x, digits=2, suffix=""):
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


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
        lines.append(f"| {name} | {_fmt(o['tok_s'], 1)} | {_fmt(o['speedup_vs_hf'], 2, 'x')} | "
                     f"{_fmt(o['speedup_vs_ar'], 2, 'x')} | {_fmt(o['mean_accepted'])} | "
                     f"{_fmt(o.get('draft_ms_per_step'), 1)} | {_fmt(o.get('verify_ms_per_step'), 1)} | "
                     f"{_fmt(o['identical_frac'])} |")
    tasks = list(dict.fromkeys(t for e in methods.values() for t in e["by_task"]))
    ref = "speedup_vs_hf" if "hf" in methods else "speedup_vs_ar"
    lines += ["", f"{ref.replace('_', ' ')} by task (mean accepted tokens per step in brackets):", "",
              "| method | " + " | ".join(tasks) + " | overall |",
              "|---|" + "---:|" * (len(tasks) + 1)]
    for name, entry in methods.items():
        cells = []
        for t in tasks + ["overall"]:
            s = entry["overall"] if t == "overall" else entry["by_task"].get(t)
            cells.append("–" if s is None else f"{_fmt(s[ref], 2, 'x')} ({_fmt(s['mean_accepted'])})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def speedup_plot(results: dict, path: str | Path) -> None:
    """Grouped bars: one group per task (and overall), one bar per method."""
    methods = results["methods"]
    ref = "speedup_vs_hf" if "hf" in methods else "speedup_vs_ar"
    tasks = list(dict.fromkeys(t for e in methods.values() for t in e["by_task"])) + ["overall"]
    fig, ax = subplots(figsize=(max(6.0, 1.3 * len(tasks) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for j, (name, entry) in enumerate(methods.items()):
        vals = []
        for t in tasks:
            s = entry["overall"] if t == "overall" else entry["by_task"].get(t)
            vals.append((s or {}).get(ref) or 0.0)
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(tasks))]
        ax.bar(xs, vals, width, label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(tasks)), tasks, rotation=20)
    ax.set(ylabel=ref.replace("_", " "), title=f"{results.get('model')} ({results.get('dtype')})")
    ax.legend(fontsize=8, ncols=min(4, len(methods)))
    save(fig, path)
