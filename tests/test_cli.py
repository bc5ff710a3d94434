"""The command line: clear one-line errors for user mistakes, JSON output, and the bench harness."""

import json
import sys
from pathlib import Path

import pytest

from speculum.cli import main
from speculum.models import default_dtype, dtype_name


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.startswith("speculum: error:")
    return err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "", "--max-new-tokens", "4"], "empty"),
    (["generate", "--prompt", "hi", "--method", "nope"], "unknown method"),
    (["generate", "--prompt", "hi", "--model", "no-such-model"], "unknown model"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
    (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "hi", "--dtype", "int3"], "dtype"),
    (["bench", "--methods", "ar,warp"], "unknown method"),
    (["bench", "--data", "/nonexistent.jsonl"], "does not exist"),
    (["generate", "--prompt", "hi", "--method", "draft_model"], "needs a draft model"),
    (["bench", "--workload", "serving", "--concurrency", "0,4"], "--concurrency levels"),
    (["bench", "--workload", "serving", "--concurrency", "four"], "comma-separated integers"),
    (["bench", "--workload", "serving", "--requests", "0"], "--requests"),
    (["bench", "--workload", "serving", "--methods", "hf_pld"], "one engine method"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
    (["serve", "--threads", "0"], "--threads"),
    (["bench", "--workload", "serving", "--tasks", "poetry"], "no prompt of --tasks"),
])
def test_user_errors_are_one_line(capsys, argv, needle):
    assert needle in _err(capsys, argv)


@pytest.mark.slow
def test_prompt_longer_than_context(capsys):
    assert "context" in _err(capsys, ["generate", "--prompt", "word " * 9000, "--max-new-tokens", "4"])


@pytest.mark.slow
def test_draft_model_with_other_tokenizer(capsys):
    err = _err(capsys, ["generate", "--prompt", "hi", "--method", "draft_model", "--draft-model", "gemma3"])
    assert "tokenizer differs" in err


@pytest.mark.slow
def test_generate_json(capsys):
    assert main(["generate", "--prompt", "Name three fruits.", "--max-new-tokens", "12", "--json",
                 "--method", "ngram"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"text", "new_tokens", "time_s", "tok_s", "mean_accepted", "steps"}
    assert 1 <= out["new_tokens"] <= 12 and out["steps"] <= out["new_tokens"] and out["mean_accepted"] >= 1


@pytest.mark.slow
def test_generate_streams_text(capsys):
    assert main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "8", "--method", "ar"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tok/s" in captured.err


@pytest.mark.slow
def test_bench_writes_results(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--per-task", "1", "--max-new-tokens", "8", "--methods", "hf,ar,ngram",
                 "--weights", "float", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res) >= {"model", "dtype", "machine", "versions", "methods"}
    assert set(res["methods"]) == {"hf", "ar", "ngram"}
    for entry in res["methods"].values():
        assert set(entry["by_task"]) == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
        assert set(entry["overall"]) >= {"tok_s", "speedup_vs_hf", "speedup_vs_ar", "mean_accepted",
                                         "identical_frac"}
    assert res["methods"]["ar"]["overall"]["speedup_vs_ar"] == 1.0
    assert res["methods"]["ar"]["overall"]["identical_frac"] == 1.0
    assert (out / "results.md").read_text().startswith("Model")
    assert (out / "speedup.png").stat().st_size > 1000


@pytest.mark.parametrize("argv,needle", [
    (["calibrate", "--dtypes", "int3"], "dtype"),
    (["calibrate", "--dtypes", ","], "empty"),
    (["bench", "--workload", "repeated", "--rounds", "0"], "rounds"),
])
def test_calibrate_and_workload_errors(capsys, argv, needle):
    assert needle in _err(capsys, argv)


@pytest.mark.slow
def test_calibrate_writes_curve_and_plot(tmp_path, capsys):
    out = tmp_path / "cal"
    assert main(["calibrate", "--dtypes", "auto", "--out", str(out)]) == 0
    rep = json.loads((out / "calibration.json").read_text())
    cost = rep[dtype_name(default_dtype())]["cost"]  # bfloat16 where the CPU runs it, else float32
    assert cost["tokens"][0] == 1 and len(cost["seconds"]) == len(cost["contexts"])
    assert all(s > 0 for row in cost["seconds"] for s in row)
    assert (out / "calibration.png").stat().st_size > 1000
    assert "tree budget" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_repeated_workload_reports_rounds(tmp_path):
    out = tmp_path / "r"
    assert main(["bench", "--workload", "repeated", "--rounds", "2", "--per-task", "1", "--max-new-tokens", "8",
                 "--methods", "ar,suffix", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]["suffix"]["by_task"]) == {"round1", "round2"}
    assert res["methods"]["suffix"]["overall"]["identical_frac"] is not None


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "hi", "--regex", "a", "--choice", "x,y"], "at most one"),
    (["generate", "--prompt", "hi", "--json-schema", "/nonexistent.json"], "not a file"),
    (["generate", "--prompt", "hi", "--regex", "(unclosed", "--max-new-tokens", "4"], "invalid regex"),
    (["bench", "--workload", "structured"], "--schemas"),
    (["bench", "--workload", "structured", "--schemas", "/nonexistent.jsonl"], "does not exist"),
    (["bench", "--workload", "structured", "--schemas", "pyproject.toml"], "not a JSONSchemaBench"),
    (["serve", "--method", "warp"], "unknown method"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--deterministic", "--runner", "hf"], "native runner"),
])
def test_constraint_and_serve_errors(capsys, argv, needle):
    assert needle in _err(capsys, argv)


def test_structured_bench_refuses_methods_without_grammar_support(capsys, tmp_path):
    schemas = tmp_path / "s.jsonl"
    schemas.write_text(json.dumps({"id": "a", "dataset": "t", "schema": {"type": "object"}}) + "\n")
    argv = ["bench", "--workload", "structured", "--schemas", str(schemas), "--methods", "hf,hf_pld"]
    assert "not hf_pld" in _err(capsys, argv)


@pytest.mark.slow
def test_generate_with_choice_constraint(capsys):
    assert main(["generate", "--prompt", "Is fire hot?", "--choice", "yes,no", "--method", "ngram",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")


@pytest.mark.slow
def test_bench_structured_reports_coverage_and_validity(tmp_path):
    schemas = tmp_path / "s.jsonl"
    rows = [
        {"id": "a", "dataset": "t", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"]}},
        {"id": "b", "dataset": "t", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        {"id": "c", "dataset": "t", "schema": {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
                                               "required": ["colour"]}},
    ]
    schemas.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "st"
    assert main(["bench", "--workload", "structured", "--schemas", str(schemas), "--methods", "hf,ar,ngram",
                 "--weights", "float", "--max-new-tokens", "24", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["coverage"]["compiled"] == 2 and res["coverage"]["total"] == 3
    assert res["schemas_run"] == ["a", "c"]
    for m in ("hf", "ar", "ngram"):
        assert res["methods"][m]["valid"] == 1.0, m
        assert res["methods"][m]["decode_ratio"] > 0, m
    per_schema = [json.loads(line) for line in (out / "per_schema.jsonl").read_text().splitlines()]
    assert all(0 < r["prefill_s"] < r["time_s"] for r in per_schema)  # hf's prefill is timed too
    assert "oneOf" in (out / "results.md").read_text()


@pytest.mark.parametrize("argv,needle", [
    (["longctx", "--policies", "full,nope"], "unknown KV policy"),
    (["longctx", "--budget", "0"], "KV budget"),
    (["longctx", "--tasks", "haystack"], "unknown task"),
    (["longctx", "--lengths", "1k"], "--lengths"),
    (["longctx", "--samples", "0"], "--samples"),
    (["longctx", "--policies", "tidal:layers"], "key=value"),
    (["generate", "--prompt", "hi", "--kv-policy", "quest:page=x"], "bad option"),
])
def test_longctx_errors(capsys, argv, needle):
    assert needle in _err(capsys, argv)


@pytest.mark.slow
def test_kv_policy_needs_an_engine_method(capsys):
    assert "no speculum KV policy" in _err(capsys, ["generate", "--prompt", "hi", "--method", "hf",
                                                     "--weights", "float", "--kv-policy", "snapkv"])


def test_hf_methods_refuse_quantized_weights(capsys):
    """The default model loads with its GGUF weights, which transformers cannot run: the hf methods say
    so before any weights load, and name the way out."""
    err = _err(capsys, ["generate", "--prompt", "hi", "--method", "hf"])
    assert "quantized weights" in err and "--weights float" in err


@pytest.mark.slow
def test_longctx_writes_results(tmp_path, capsys):
    out = tmp_path / "lc"
    rc = main(["longctx", "--lengths", "512", "--tasks", "niah_single", "--samples", "1",
               "--policies", "snapkv,full,tidal", "--budget", "0.25,64", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())
    fields = {"policy", "budget", "length", "task", "accuracy", "kv_bytes", "peak_rss_bytes", "decode_tok_s"}
    assert all(fields <= set(r) for r in rows)
    got = {(r["policy"], r["budget"]) for r in rows if r["task"] == "niah_single"}
    assert got == {("full", "-"), ("snapkv", "0.25"), ("snapkv", "64"), ("tidal", "0.25"), ("tidal", "64")}
    full = next(r for r in rows if r["policy"] == "full" and r["task"] == "all")
    snap = next(r for r in rows if r["policy"] == "snapkv" and r["budget"] == "64" and r["task"] == "all")
    assert snap["kv_bytes"] < 0.3 * full["kv_bytes"]
    assert (out / "results.md").exists() and (out / "accuracy.png").exists()
    assert "| snapkv | 64 |" in capsys.readouterr().out


def test_bench_tasks_keeps_only_those_tasks():
    """``bench --tasks`` filters every Spec-Bench workload, MT-bench's categories under one name."""
    from speculum.bench.data import demo_prompts_path, load_prompts
    from speculum.cli.bench import only_tasks as _only_tasks
    from speculum.errors import SpeculumError

    prompts = load_prompts(demo_prompts_path())
    kept = _only_tasks(prompts, "mt_bench, rag")
    assert kept and {p.task for p in kept} == {"mt_bench", "rag"}
    assert _only_tasks(prompts, None) == prompts
    with pytest.raises(SpeculumError, match="no prompt of --tasks"):
        _only_tasks(prompts, "nonexistent")


def test_longctx_plot_merges_runs_first_run_first(tmp_path, monkeypatch):
    """``benchmarks/longctx_plot.py`` draws several runs' policies in one plot, a (policy, budget, length,
    task) taken from the first run that has it, the legend beside the panel once there are many."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("longctx_plot", Path(__file__).parents[1] / "benchmarks" / "longctx_plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)

    def row(policy, budget, accuracy):
        return {"policy": policy, "budget": budget, "length": 4096, "task": "all", "accuracy": accuracy,
                "kv_bytes": 100 if budget == "-" else 25}

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "results.json").write_text(json.dumps([row("full", "-", 60.0)] + [row(f"p{i}", "0.25", i) for i in range(8)]))
    (b / "results.json").write_text(json.dumps([row("full", "-", 10.0), row("p0", "0.25", 99.0)]
                                               + [row(f"q{i}", "0.5", i) for i in range(4)]))
    rows = plot.merged_rows([a / "results.json", b / "results.json"])
    assert len(rows) == 13 and [r["accuracy"] for r in rows if r["policy"] in ("full", "p0")] == [60.0, 0]
    monkeypatch.setattr(sys, "argv", ["longctx_plot.py", str(tmp_path / "all.png"), str(a), str(b)])
    plot.main()
    assert (tmp_path / "all.png").stat().st_size > 0
