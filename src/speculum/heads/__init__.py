"""Learned draft heads: their weights on disk, the shipped ones, and the target tensors they share.

A head file is one safetensors file: the trained weights (bfloat16), an optional ``draft_vocab``
``[K]`` (the token ids of a trimmed LM head: FR-Spec / VocabTrim) and, in its metadata, the head's
kind, shape and the target it was trained for. Heads trained by ``speculum train-draft`` for the
packaged models ship in ``speculum/heads/weights/<target key>/<kind>.safetensors``;
:func:`find_head` finds them, ``--draft-head PATH`` loads a user's own.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculumError
from ..models import target_key
from .clover import CloverConfig, CloverHeads
from .eagle import EagleConfig, EagleHead, HeadCache
from .hydra import HydraConfig, HydraHeads
from .kangaroo import KangarooAdapter, KangarooConfig
from .kinds import LEARNED, LearnedKind
from .medusa import MedusaConfig, MedusaHeads
from .ppd import PPDConfig, PPDPrompts

SHIPPED = Path(__file__).parent / "weights"

__all__ = [
    "LEARNED",
    "CloverConfig",
    "CloverHeads",
    "EagleConfig",
    "EagleHead",
    "HeadCache",
    "HeadFiles",
    "HydraConfig",
    "HydraHeads",
    "KangarooAdapter",
    "KangarooConfig",
    "LearnedKind",
    "LoadedHead",
    "MedusaConfig",
    "MedusaHeads",
    "PPDConfig",
    "PPDPrompts",
    "TargetTables",
    "find_head",
    "head_for_target",
    "head_kind",
    "load_head",
    "pick_head",
    "save_head",
    "shipped_draft_vocab",
    "target_key",
]


def find_head(model, kind: str) -> Path | None:
    """The shipped ``kind`` head for ``model``, if speculum ships one."""
    key = target_key(model)
    path = SHIPPED / key / f"{kind}.safetensors"
    return path if key and path.is_file() else None


def shipped_draft_vocab(model) -> torch.Tensor | None:
    """The draft vocabulary ``[K]`` (token ids) of a head shipped for ``model``: the tokens most
    frequent in the model's own outputs on the training prompts (FR-Spec / VocabTrim), which a
    self-draft's trimmed LM head also uses; None where no shipped head has one."""
    from safetensors import safe_open

    for kind in LEARNED:
        path = find_head(model, kind)
        if path is None:
            continue
        with safe_open(str(path), "pt") as f:
            if "draft_vocab" in f.keys():  # noqa: SIM118 - safe_open is not iterable
                return f.get_tensor("draft_vocab")
    return None


@dataclass
class TargetTables:
    """The target's frozen tensors a head drafts with.

    ``embed [V, D]`` token embeddings (times ``embed_scale`` where the model scales them, Gemma);
    ``head [K, D]`` the LM head's rows for the draft vocabulary; ``vocab [K]`` their token ids (None:
    all ``V``, in order); ``softcap``: the final logit soft-capping (Gemma-2), or None; ``prenorm``:
    a norm ``[..., D] -> [..., D]`` before ``head`` (a head with an LM head of its own, EAGLE-3's), or None.
    """

    embed: torch.Tensor
    embed_scale: float | None
    head: torch.Tensor
    vocab: torch.Tensor | None
    softcap: float | None
    quantized: object = None  # the target's quantized LM head rows, which drafting then runs
    quantized_embed: object = None  # the target's quantized embedding table, rows dequantized as looked up
    prenorm: object = None

    def __post_init__(self):
        from ..runners.packed import packed_linear

        # for drafting (no gradient): the head's rows prepacked for oneDNN where that applies (a quantized
        # head runs on its kernels instead of a packed float copy)
        self.packed = (packed_linear(self.head) if not self.head.requires_grad and self.quantized is None
                       else None)

    @classmethod
    def of(cls, model, draft_vocab: torch.Tensor | None = None, dtype: torch.dtype | None = None,
           drafting: bool = False) -> TargetTables:
        """The tables of a transformers causal LM ``model`` (its embedding and LM head, which the native
        runner leaves in place), trimmed to ``draft_vocab`` when given. ``drafting`` (no training):
        where the model's head is quantized and ``dtype`` float32, the draft logits run on its
        quantized rows and embeddings are looked up in its quantized table, and ``head`` (and, for a
        quantized table, ``embed``) is left empty (``[0, D]``) instead of a float copy."""
        from ..weights import float_weight, quantized_head, quantized_of

        embed_module = model.get_input_embeddings()
        qhead = quantized_head(model) if drafting and dtype == torch.float32 else None
        qembed = quantized_of(model).get("model.embed_tokens.weight") if qhead is not None else None
        if qembed is not None:  # no float copy: rows dequantized as they are looked up
            from ..weights import QuantizedEmbedding

            qembed = QuantizedEmbedding(qembed)
            embed = torch.empty(0, qembed.embedding_dim)
        else:
            embed = float_weight(model, "model.embed_tokens.weight")  # dequantized where the model is quantized
        dtype = dtype or embed.dtype
        scale = getattr(embed_module, "embed_scale", None)
        scale = float(scale) if scale is not None else None
        quantized = None
        if qhead is not None:
            from ..weights import QuantizedLinear

            quantized = QuantizedLinear(qhead if draft_vocab is None else qhead.rows(draft_vocab.to(torch.int64)))
            head = embed.new_empty(0, embed.shape[1])
        else:
            head = float_weight(model, "lm_head.weight")
            if draft_vocab is not None:
                draft_vocab = draft_vocab.to(head.device)  # indexed by drafted ids on the model's device
                head = head.index_select(0, draft_vocab)
        cfg = model.config.get_text_config()
        return cls(embed.to(dtype), scale, head.to(dtype).contiguous(), draft_vocab,
                   getattr(cfg, "final_logit_softcapping", None), quantized, qembed)

    def full_logits(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., K]`` -> ``[..., V]``, ``-inf`` outside the draft vocabulary."""
        if self.vocab is None:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, draft_logits)

    def embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` -> ``[..., D]``."""
        if self.quantized_embed is not None:
            e = self.quantized_embed(ids).to(self.embed.dtype)
        else:
            e = torch.nn.functional.embedding(ids, self.embed)
        return e * self.embed_scale if self.embed_scale is not None else e

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns ``[...]`` -> token ids ``[...]``."""
        return columns if self.vocab is None else self.vocab[columns]

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[..., D]`` -> draft-vocabulary logits ``[..., K]``."""
        if self.prenorm is not None:
            feats = self.prenorm(feats)
        if self.quantized is not None and not torch.is_grad_enabled():
            out = self.quantized(feats.float()).to(feats.dtype)
        elif self.packed is not None and not torch.is_grad_enabled():
            out = self.packed(feats)
        else:
            out = feats @ self.head.T
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


@dataclass
class LoadedHead:
    """A head read from disk: the module, its kind, its draft vocabulary and its metadata."""

    kind: str
    module: torch.nn.Module
    draft_vocab: torch.Tensor | None  # [K] token ids, or None for the whole vocabulary
    meta: dict


def save_head(path: str | Path, kind: str, module: torch.nn.Module, draft_vocab: torch.Tensor | None, meta: dict) -> Path:
    """Write ``module``'s weights in bfloat16 (and ``draft_vocab``) to one safetensors file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    header = {"kind": kind, "config": json.dumps(module.config.to_dict()), "meta": json.dumps(meta)}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=header)
    tmp.replace(path)
    return path


def load_head(path: str | Path, model=None) -> LoadedHead:
    """Read a head file, or a published head's directory or hub id (:mod:`~speculum.heads.published`);
    with ``model``, check that it fits that target (hidden size, vocabulary)."""
    from .published import is_published, read_published

    loaded = read_published(path, model) if is_published(path) else _read_file(path)
    config, meta, vocab, name = loaded.module.config, loaded.meta, loaded.draft_vocab, Path(path).name
    if model is not None:
        cfg = model.config.get_text_config()
        width = model.get_output_embeddings().weight.shape[0]
        if config.hidden != cfg.hidden_size:
            raise SpeculumError(f"draft head {name} was trained for hidden size {config.hidden}, "
                                f"this model's is {cfg.hidden_size}")
        if meta.get("vocab") not in (None, width) or (vocab is not None and int(vocab.max()) >= width):
            raise SpeculumError(f"draft head {name} was trained for a vocabulary of {meta.get('vocab')}, "
                                f"this model's logits are {width} wide")
    return loaded


def _read_file(path: str | Path) -> LoadedHead:
    from safetensors import safe_open

    kind = head_kind(path)  # checks that it is a head file
    with safe_open(str(Path(path).expanduser()), "pt") as f:
        header = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    spec = LEARNED[kind]
    vocab = tensors.pop("draft_vocab", None)
    module = spec.module(spec.config(**json.loads(header["config"])))
    module.load_state_dict({k: v.float() for k, v in tensors.items()})
    return LoadedHead(kind, module.eval().requires_grad_(False), vocab, json.loads(header.get("meta", "{}")))


# target model -> {head file: (frozen head module, target tables)}: every method of one target (a
# server builds one per tenant) shares one copy of a head's weights
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# head files, published heads' directories or hub ids a user gave (--draft-head), any kinds
HeadFiles = str | Path | Sequence[str | Path] | None


def head_kind(path: str | Path) -> str:
    """The kind written in a head file's header, or a published head's (a missing or foreign file
    raises :class:`SpeculumError`)."""
    from safetensors import safe_open

    from .published import is_published, published_kind

    if is_published(path):
        return published_kind(path)
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpeculumError(f"draft head {str(path)!r} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            kind = (f.metadata() or {}).get("kind")
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say what it is
        raise SpeculumError(f"{path} is not a speculum draft head ({e})") from None
    if kind not in LEARNED:
        raise SpeculumError(f"{path} is not a speculum draft head (kind {kind!r}; known: {', '.join(LEARNED)})")
    return kind


def pick_head(files: HeadFiles, kind: str) -> Path | None:
    """The file (or published head's directory, a hub id's downloaded) of ``kind`` among ``files`` (a
    path or several, matched by the kind in each header)."""
    from .published import is_published, local_dir

    if files is None:
        return None
    for path in [files] if isinstance(files, str | Path) else files:
        if head_kind(path) == kind:
            return local_dir(path) if is_published(path) else Path(path).expanduser()
    return None


def head_for_target(target: torch.nn.Module, kind: str, files: HeadFiles,
                    full_vocab: bool = False) -> tuple[torch.nn.Module, TargetTables, Path]:
    """The ``kind`` head among the user's ``files`` (default: the one shipped for ``target``), in the
    target's dtype and device and ready to draft, with the target tables it drafts through (its
    trimmed draft vocabulary, or with ``full_vocab`` the whole LM head); loaded once per target."""
    path = pick_head(files, kind)
    if files and path is None:
        given = ", ".join(str(p) for p in ([files] if isinstance(files, str | Path) else files))
        raise SpeculumError(f"no {kind} head among the draft-head files given ({given})")
    path = path or find_head(target, kind)
    if path is None:
        raise SpeculumError(f"{kind} needs a trained head: speculum ships none for this model; train one with "
                            f"`speculum train-draft --kind {kind}` and pass --draft-head PATH")
    path = Path(path).expanduser()
    if not path.exists():
        raise SpeculumError(f"draft head {str(path)!r} does not exist")
    per_target = _LOADED.setdefault(target, {})
    key = str(path.resolve())
    if key not in per_target:
        loaded = load_head(path, target)
        if loaded.kind != kind:
            raise SpeculumError(f"{path} holds a {loaded.kind} head, not a {kind} head")
        from ..weights import model_device, model_dtype

        dtype = model_dtype(target)
        tables = TargetTables.of(target, loaded.draft_vocab, dtype, drafting=True)
        head = loaded.module.to(dtype).to(model_device(target))
        # a target on quantized weights (its LM head drafting on its quantized rows): the head's own
        # products on Q8_0 copies too, a quarter of float32's bytes, where its freeze() takes that
        quantize = tables.quantized is not None and "quantized" in inspect.signature(head.freeze).parameters
        head = head.freeze(quantized=True) if quantize else head.freeze()
        per_target[key] = head, head.own_tables(tables) if hasattr(head, "own_tables") else tables
    head, tables = per_target[key]
    if full_vocab and tables.vocab is not None and tables.prenorm is None:  # (an LM head of its own: no other)
        if (key, "full") not in per_target:
            per_target[key, "full"] = TargetTables.of(target, None, tables.embed.dtype, drafting=True)
        tables = per_target[key, "full"]
    return head, tables, path
