"""Published draft heads in their released layouts (``--draft-head DIR|HUB_ID``), read into speculum's
own modules, which the ``eagle`` and ``medusa`` drafters then draft with.

- EAGLE-1/2 (e.g. ``yuhuili/EAGLE-llama2-chat-7B``): ``config.json`` (a LlamaConfig) and
  ``pytorch_model.bin`` or ``model.safetensors``: ``fc.weight [D, 2D]`` (and ``fc.bias`` where trained
  with one) over ``[embedding; feature]``, then ``layers.0.*``, a Llama layer without its input norm:
  :class:`~speculum.heads.eagle.EagleHead` in the ``eagle1`` layout, under the names
  ``speculum export-head`` writes (:data:`~speculum.heads.export.EAGLE_NAMES`) read back.
- EAGLE-3 (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, SpecForge's and vLLM's
  ``LlamaForCausalLMEagle3``): ``fc.weight [D, 3D]`` over three target layers' states, ``midlayer.*``
  (``q/k/v [., 2D]``, ``hidden_norm``), ``norm``, ``lm_head [K, D]`` and ``d2t [K]`` (draft row ``i``
  is target token ``i + d2t[i]``): the ``eagle3`` layout. The fused layers are the config's
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's numbering, speculum's too: ``j`` is the input of
  target layer ``j``), else the reference's ``(2, L // 2, L - 3)`` for a target of ``L`` layers.
- Medusa (e.g. ``FasterDecoding/medusa-vicuna-7b-v1.3``): ``medusa_lm_head.safetensors`` (or ``.pt``),
  head ``i``'s residual blocks ``{i}.{j}.linear.*`` then its own LM head ``{i}.{layers}.weight [V, D]``:
  :class:`~speculum.heads.medusa.MedusaHeads` with ``vocab = V`` (the shape comes from the weights).

EAGLE-1/2 and Medusa read the target's final-norm feature, as their reference code does; every head
embeds tokens with the target's embedding (an ``embed_tokens.weight`` in the file is not read). A
hub id (``owner/name``, no path here) is downloaded with ``huggingface_hub`` (config and weights only).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import SpeculumError
from . import LoadedHead
from .eagle import EagleConfig, EagleHead
from .export import EAGLE_NAMES
from .medusa import MedusaConfig, MedusaHeads

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
KNOWN = "EAGLE-1/2 (fc and layers.0 weights), EAGLE-3 (midlayer weights) or Medusa (a medusa_lm_head file)"
SUFFIXES = (".safetensors", ".bin", ".pt")
# released name -> speculum's; the names in IGNORED are not read (the target's embedding is used;
# EAGLE-1's layer 0 has no input norm; t2d is d2t's inverse)
EAGLE1 = {v: k for k, v in EAGLE_NAMES.items()} | {"fc.bias": "fc.bias"}
EAGLE3 = {v.replace("layers.0.", "midlayer."): k for k, v in EAGLE_NAMES.items() if k != "fc.weight"} | {
    "fc.weight": "fuse.weight", "midlayer.input_layernorm.weight": "input_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight", "d2t": "d2t"}
IGNORED = {"embed_tokens.weight", "t2d", "layers.0.input_layernorm.weight"}


def is_published(where: str | Path) -> bool:
    """Whether ``where`` names a published head: a directory, or a hub id that is no path here."""
    path = Path(where).expanduser()
    return path.is_dir() or (not path.exists() and HUB_ID.fullmatch(str(where)) is not None
                             and not str(where).endswith(SUFFIXES))


def local_dir(where: str | Path) -> Path:
    """The directory of a published head: ``where``, or a hub id's download."""
    path = Path(where).expanduser()
    return path if path.is_dir() else _download(str(where))


@functools.cache
def _download(repo: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, allow_patterns=["config.json", *(f"*{s}" for s in SUFFIXES)]))
    except Exception as e:  # noqa: BLE001 - offline, no such repository, no access: say which
        raise SpeculumError(f"draft head {repo!r} is no file or directory here, and downloading it from the "
                            f"Hugging Face hub failed ({type(e).__name__}: {e})") from None


def _layout(d: Path) -> tuple[str, list[Path]]:
    """``d``'s layout (``eagle1``, ``eagle3`` or ``medusa``) and its weight files (safetensors where
    a directory holds both kinds)."""
    files = sorted(p for p in d.iterdir() if p.suffix in SUFFIXES)
    files = [p for p in files if p.suffix == ".safetensors"] or files
    medusa = [p for p in files if p.stem == "medusa_lm_head"]
    if medusa:
        return "medusa", medusa
    keys = set().union(*(_read(p, keys_only=True) for p in files))
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3", files
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle1", files
    raise SpeculumError(f"{d} holds no draft head speculum knows: a head file from `speculum train-draft`, "
                        f"or a directory of {KNOWN}")


def _read(path: Path, keys_only: bool = False):
    """A weight file's tensors (``pytorch_model.bin`` / ``.pt`` with ``weights_only``), or its names."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                return set(f.keys()) if keys_only else {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise SpeculumError(f"cannot read the draft head's weights {path} ({type(e).__name__}: {e})") from None


def published_kind(where: str | Path) -> str:
    """The speculum kind (``eagle`` or ``medusa``) of a published head."""
    return "medusa" if _layout(local_dir(where))[0] == "medusa" else "eagle"


def read_published(where: str | Path, model=None) -> LoadedHead:
    """A published head as a :class:`~speculum.heads.LoadedHead` (float32, frozen); ``model`` the
    target (an EAGLE-3 head without its fused layers in its config takes the reference's)."""
    d = local_dir(where)
    layout, files = _layout(d)
    state = {k: v for p in files for k, v in _read(p).items()}
    try:
        module, state, vocab = _medusa(state) if layout == "medusa" else _eagle(d, layout, state, model)
        module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except SpeculumError:
        raise
    except (KeyError, ValueError, RuntimeError) as e:
        raise SpeculumError(f"{d}: its {layout} weights and config do not fit together ({e})") from None
    kind = "medusa" if layout == "medusa" else "eagle"
    return LoadedHead(kind, module.eval().requires_grad_(False), None,
                      {"vocab": vocab, "layout": layout, "source": str(where)})


def _eagle(d: Path, layout: str, state: dict, model) -> tuple[EagleHead, dict, int | None]:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpeculumError(f"{d}: an EAGLE head's config.json is missing or unreadable ({e})") from None
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpeculumError(f"{d}: the head's RoPE scaling {rope} is not supported (speculum's EAGLE layer ropes plainly)")
    if cfg.get("norm_before_residual") or cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise SpeculumError(f"{d}: an EAGLE-3 head with norm_before_residual or a target_hidden_size of its own "
                            f"is not supported")
    cfg.setdefault("rope_theta", rope.get("rope_theta"))
    fuse, draft_vocab, names = (), 0, EAGLE1
    if layout == "eagle3":
        names = EAGLE3
        fuse = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if not fuse:
            if model is None:
                raise SpeculumError(f"{d}: an EAGLE-3 head that names no fused layers needs its target to pick them")
            top = model.config.get_text_config().num_hidden_layers
            fuse = (2, top // 2, top - 3)
        draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
        state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # (none: draft ids are target ids)
    c = EagleConfig.for_target(SimpleNamespace(**cfg), fuse, "eagle1")
    c = dataclasses.replace(c, layout=layout, draft_vocab=draft_vocab, fc_bias="fc.bias" in state)
    state = {names.get(k, k): v for k, v in state.items() if k not in IGNORED}
    if layout == "eagle1":
        state["input_norm.weight"] = torch.ones(c.hidden)  # (the eagle1 layout does not read it)
    return EagleHead(c), state, cfg.get("vocab_size")


def _medusa(state: dict) -> tuple[MedusaHeads, dict, int]:
    heads = 1 + max(int(k.split(".")[0]) for k in state)
    layers = sum(f"0.{j}.linear.weight" in state for j in range(len(state)))
    vocab, hidden = state[f"0.{layers}.weight"].shape
    lm_head = torch.stack([state.pop(f"{i}.{layers}.weight") for i in range(heads)])  # [K, V, D]
    state = {f"heads.{k}": v for k, v in state.items()} | {"lm_head": lm_head}
    return MedusaHeads(MedusaConfig(hidden, heads, layers, vocab)), state, vocab
