"""Model resolution, the dequantized-weight cache, and benchmark prompt selection."""

import json

import pytest
import torch

from speculum.bench.data import demo_prompts_path, load_prompts
from speculum.errors import SpeculumError
from speculum.models import cache_dir, file_sha256, resolve


def test_resolve_errors(tmp_path):
    with pytest.raises(SpeculumError, match="unknown model"):
        resolve("not-a-model")
    with pytest.raises(SpeculumError, match="no config.json"):
        resolve(str(tmp_path))
    assert resolve("org/name") == ("hub", "org/name")
    assert resolve("default")[0] == "gguf"


def test_sha_memo(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "c"))
    f = tmp_path / "x.gguf"
    f.write_bytes(b"abc")
    h = file_sha256(f)
    assert h == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert h in (cache_dir() / "hashes.json").read_text()


@pytest.mark.slow
def test_second_load_uses_safetensors_cache(smollm2_f32):
    _kind, path = resolve("default")
    from pathlib import Path

    d = cache_dir() / "dequantized" / file_sha256(Path(path))
    assert (d / "config.json").exists() and any(d.glob("*.safetensors"))


def test_per_task_selection_spreads_mt_bench(tmp_path):
    cats = ["writing"] * 3 + ["coding"] * 3 + ["qa"] * 3
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]})
                           for i, c in enumerate(cats)))
    chosen = load_prompts(p, per_task=2)
    assert [(c.task, c.category) for c in chosen] == [("mt_bench", "writing"), ("mt_bench", "coding"),
                                                       ("qa", "qa"), ("qa", "qa")]
    with pytest.raises(SpeculumError):
        load_prompts(p, per_task=0)


def test_demo_prompts_cover_all_tasks():
    tasks = {p.task for p in load_prompts(demo_prompts_path())}
    assert tasks == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


@pytest.mark.parametrize("native_bf16,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_cpu(monkeypatch, native_bf16, expected):
    """``auto`` (and no dtype) is bfloat16 only on CPUs that run it natively; names still win."""
    from speculum import models

    monkeypatch.setattr(models, "cpu_runs_bfloat16", lambda: native_bf16)
    assert models.parse_dtype("auto", "cpu") == expected
    assert models.parse_dtype(None, "cpu") == expected
    assert models.parse_dtype("bf16", "cpu") == torch.bfloat16
    assert models.dtype_name(models.parse_dtype("AUTO", "cpu")) == str(expected).removeprefix("torch.")
