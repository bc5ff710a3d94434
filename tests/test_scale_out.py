"""Scale-out pieces that run without vLLM or Ray: head export in vLLM's layouts (checked against the
network vLLM builds from them, rebuilt here from transformers' Llama layer), ``serve --replicas``'s
refusals, and the Ray deployment's absence of Ray."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file

from speculum.errors import SpeculumError
from speculum.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head
from speculum.heads.export import export_eagle, export_medusa


def _head(layout: str, fuse=()) -> EagleHead:
    target = tiny_llama()
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.for_target(target.config, fuse, layout)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms away from 1, so a misplaced norm would show
    return target, head


def test_eagle_export_is_the_network_vllm_builds(tmp_path):
    """vLLM's EagleLlamaForCausalLM: fc([embedding; feature]) -> a Llama decoder layer whose input
    norm is the identity -> hidden + residual. Rebuilt from the exported files with transformers'
    LlamaDecoderLayer, it must give the head's own predicted features."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target, head = _head("eagle1")
    head = head.to(torch.bfloat16).float()  # what the file keeps
    path = save_head(tmp_path / "eagle.safetensors", "eagle", head, None, {})
    out = export_eagle(path, target.config, tmp_path / "vllm-eagle")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == target.config.vocab_size and config["hidden_size"] == 64
    weights = load_file(str(out / "model.safetensors"))
    assert "fc.bias" not in weights and not any("input_layernorm" in k or "embed" in k or "lm_head" in k
                                                 for k in weights)

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "speculum", "torch_dtype")})
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    state = {k.removeprefix("layers.0."): v.float() for k, v in weights.items() if k.startswith("layers.0.")}
    state["input_layernorm.weight"] = torch.ones(64)  # (replaced by the identity below, as vLLM does)
    layer.load_state_dict(state)
    layer.input_layernorm = torch.nn.Identity()
    fc = torch.nn.Linear(128, 64, bias=False)
    fc.weight.data = weights["fc.weight"].float()

    torch.manual_seed(2)
    feats, embeds = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    positions = torch.arange(7)[None]
    h = fc(torch.cat((embeds, feats), dim=-1))
    rope = LlamaRotaryEmbedding(cfg)(h, positions)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        ours = head(feats, embeds)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_eagle_export_refuses_heads_vllm_cannot_load(tmp_path):
    target, head = _head("speculum")
    path = save_head(tmp_path / "a.safetensors", "eagle", head, None, {})
    with pytest.raises(SpeculumError, match="--layout eagle1"):
        export_eagle(path, target.config, tmp_path / "a")
    target, head = _head("eagle1", fuse=(0, 1))
    path = save_head(tmp_path / "b.safetensors", "eagle", head, None, {})
    with pytest.raises(SpeculumError, match="EAGLE-3"):
        export_eagle(path, target.config, tmp_path / "b")
    medusa = MedusaHeads(MedusaConfig(hidden=64, num_heads=2))
    path = save_head(tmp_path / "m.safetensors", "medusa", medusa, None, {})
    with pytest.raises(SpeculumError, match="medusa head"):
        export_eagle(path, target.config, tmp_path / "c")


def test_medusa_export_names_and_shared_lm_head(tmp_path):
    target = tiny_llama()
    medusa = MedusaHeads(MedusaConfig(hidden=64, num_heads=3, layers=2))
    with torch.no_grad():
        for p in medusa.parameters():
            p.add_(torch.randn_like(p))
    path = save_head(tmp_path / "medusa.safetensors", "medusa", medusa, None, {})
    out = export_medusa(path, target, tmp_path / "vllm-medusa")
    config = json.loads((out / "config.json").read_text())
    assert config["num_heads"] == 3 and config["num_hidden_layers"] == 2 and config["original_lm_head"]
    weights = load_file(str(out / "model.safetensors"))
    expected = {f"blocks.{k}.layers.{i}.{w}" for k in range(3) for i in range(2) for w in ("weight", "bias")}
    assert set(weights) == expected | {"lm_head.weight"}
    torch.testing.assert_close(weights["blocks.2.layers.1.weight"],
                               medusa.heads[2][1].linear.weight.detach().to(torch.bfloat16))
    torch.testing.assert_close(weights["lm_head.weight"], target.lm_head.weight.detach().to(torch.bfloat16))


def test_replicas_need_ray(monkeypatch):
    from speculum.integrations import ray_serve

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(SpeculumError, match=r"speculum\[ray\]"):
        ray_serve.replica_class()


@pytest.mark.parametrize("argv, message", [
    (["serve", "--replicas", "0"], "--replicas must be in 1..256"),
    (["serve", "--replicas", "2", "--port", "0"], "--port must be in"),
])
def test_serve_replicas_refuses_bad_arguments(argv, message, capsys):
    from speculum.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_export_head_cli_refuses_a_speculum_layout_head(tmp_path, capsys):
    from speculum.cli import main

    _, head = _head("speculum")
    path = save_head(tmp_path / "h.safetensors", "eagle", head, None, {})
    assert main(["export-head", str(path), "--format", "eagle", "--out", str(tmp_path / "o"),
                 "--model", "default"]) == 2
    assert "--layout eagle1" in capsys.readouterr().err
