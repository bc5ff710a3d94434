"""Trained heads in the layouts vLLM loads natively (``speculum export-head``).

- ``eagle``: a one-layer Llama draft model directory (``config.json`` + ``model.safetensors``) for
  vLLM's ``EagleLlamaForCausalLM`` (``--speculative-config '{"method": "eagle", "model": DIR, ...}'``),
  the layout of EAGLE-1's reference heads: ``fc`` ``[D, 2D]`` without bias over ``[embedding; feature]``,
  then ``layers.0`` without its input norm. The embedding and the LM head are the target's (vLLM
  shares them), so the draft vocabulary is the whole one. Only heads trained with
  ``train-draft --layout eagle1`` fit: speculum's own layout has an ``fc`` bias and an input norm,
  which vLLM's model lacks.
- ``medusa``: vLLM's ``MedusaModel`` directory: per head its residual blocks
  (``blocks.{k}.layers.{l}``, with bias), and one LM head that all heads share (``original_lm_head``),
  a copy of the target's, as in speculum.

EAGLE-3 is not exported: vLLM's EAGLE-3 layer reads ``[embedding; fused feature]`` as a ``2D``-wide
attention input with two norms, a different network from speculum's EAGLE-3 head (``fc`` of the
pair, then an ordinary layer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpeculumError
from . import load_head

FORMATS = ("eagle", "medusa")


def _target_dict(config) -> dict:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return cfg.to_dict()


def _save(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


# speculum's EAGLE head weights (``eagle1`` layout) -> EAGLE-1's and vLLM's ``EagleLlamaForCausalLM`` names
# (read back by :mod:`~speculum.heads.published`)
EAGLE_NAMES = {"fc.weight": "fc.weight", "q.weight": "layers.0.self_attn.q_proj.weight",
               "k.weight": "layers.0.self_attn.k_proj.weight", "v.weight": "layers.0.self_attn.v_proj.weight",
               "o.weight": "layers.0.self_attn.o_proj.weight",
               "post_norm.weight": "layers.0.post_attention_layernorm.weight",
               "gate.weight": "layers.0.mlp.gate_proj.weight", "up.weight": "layers.0.mlp.up_proj.weight",
               "down.weight": "layers.0.mlp.down_proj.weight"}


def eagle_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculum's EAGLE head weights (``eagle1`` layout) under vLLM's ``EagleLlamaForCausalLM`` names."""
    return {EAGLE_NAMES[k]: v for k, v in state.items() if k in EAGLE_NAMES}


def export_eagle(head_path: str | Path, target_config, out: str | Path) -> Path:
    loaded = load_head(head_path)
    if loaded.kind != "eagle":
        raise SpeculumError(f"{head_path} is a {loaded.kind} head; --format eagle takes an eagle head")
    c = loaded.module.config
    if c.fuse_layers:
        raise SpeculumError("this is an EAGLE-3 head (it fuses several target layers): vLLM's EAGLE-3 model is "
                            "another network, so it cannot be exported")
    if c.layout != "eagle1":
        raise SpeculumError("this head has speculum's layout (an fc bias and an input norm that vLLM's EAGLE model "
                            "lacks): train one for export with `speculum train-draft --kind eagle --layout eagle1`")
    if c.fc_bias:
        raise SpeculumError("this head's fc has a bias, which vLLM's EAGLE model lacks")
    config = _target_dict(target_config)
    if config.get("hidden_size") != c.hidden:
        raise SpeculumError(f"the head is {c.hidden} wide, the target {config.get('hidden_size')}")
    config.update(num_hidden_layers=1, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                  head_dim=c.head_dim, intermediate_size=c.intermediate, rms_norm_eps=c.eps,
                  architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                  speculum={"exported_from": str(head_path), "kind": "eagle", "meta": loaded.meta.get("target")})
    config.pop("dtype", None)
    return _save(Path(out), eagle_tensors(loaded.module.state_dict()), config)


def export_medusa(head_path: str | Path, target, out: str | Path) -> Path:
    """``target``: the transformers model (its LM head is copied into every head)."""
    loaded = load_head(head_path)
    if loaded.kind != "medusa":
        raise SpeculumError(f"{head_path} is a {loaded.kind} head; --format medusa takes a medusa head")
    c = loaded.module.config
    lm_head = target.get_output_embeddings().weight.detach()  # [V, D]
    tensors: dict[str, torch.Tensor] = {}
    for key, value in loaded.module.state_dict().items():
        # speculum: heads.{k}.{l}.linear.{weight,bias} -> vLLM: blocks.{k}.layers.{l}.{weight,bias}
        parts = key.split(".")
        if len(parts) == 5 and parts[0] == "heads" and parts[3] == "linear":
            tensors[f"blocks.{parts[1]}.layers.{parts[2]}.{parts[4]}"] = value
        else:
            raise SpeculumError(f"unexpected tensor {key!r} in the medusa head")
    tensors["lm_head.weight"] = lm_head  # one LM head that every head shares (original_lm_head)
    tcfg = _target_dict(target.config)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden,
              "vocab_size": tcfg["vocab_size"], "num_heads": c.num_heads, "num_hidden_layers": c.layers,
              "medusa_fc_bias": True, "original_lm_head": True, "truncated_vocab_size": None,
              "torch_dtype": "bfloat16"}
    return _save(Path(out), tensors, config)
