"""SpecDec++'s acceptance prediction head (Huang, Guo, Wang 2024, "SpecDec++: Boosting Speculative
Decoding via Adaptive Candidate Lengths", https://arxiv.org/abs/2405.19715): a small network on a
draft model's last hidden state that predicts whether the token drafted from that state will be
accepted by the target. The ``specdecpp`` drafter (:mod:`speculum.drafters.specdecpp`) stops
drafting by it; ``speculum.train.acceptance`` trains it.

The head reads ``h [..., D]``, the draft's final (normed) hidden state at the position whose
logits the token was drafted from, and returns one logit ``[...]``: ``sigmoid`` of it is the
predicted acceptance probability. ``inner=0`` makes it one linear layer; ``inner > 0`` two
(``D -> inner -> 1``, SiLU between; the paper's heads are small residual MLPs). With
``draft_prob=True`` (not in the paper) it also reads ``p [...]``, the draft's probability of the
token it drafted, as one more input: the signal the head-free stand-in predicts from.

A head file is one safetensors file (float32 weights; a few hundred KB for a 576-wide draft), its
metadata naming the kind (``acceptance``), the config and what it was trained on: the target's name
(:func:`~speculum.models.target_key`) and the draft's :func:`draft_fingerprint`. A head belongs to
one (target, draft) pair: :func:`shipped_acceptance_head` finds a shipped one
(``heads/weights/<target key>/acceptance-<draft>.safetensors``) only for the draft it was trained with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import SpeculumError
from ..models import target_key

KIND = "acceptance"
SHIPPED = Path(__file__).parent / "weights"


@dataclass(frozen=True)
class AcceptanceConfig:
    hidden: int  # D, the draft model's hidden size
    inner: int = 64  # 0: a linear head; else the MLP's width
    draft_prob: bool = False  # also read the draft's probability of its token

    def to_dict(self) -> dict:
        return asdict(self)


class AcceptanceHead(torch.nn.Module):
    """``h [..., D]`` (and with ``draft_prob`` ``p [...]``) ``-> logit [...]`` of P(the token
    drafted from h is accepted)."""

    def __init__(self, config: AcceptanceConfig):
        super().__init__()
        self.config = config
        width = config.hidden + int(config.draft_prob)
        if config.inner > 0:
            self.net = torch.nn.Sequential(torch.nn.Linear(width, config.inner), torch.nn.SiLU(),
                                           torch.nn.Linear(config.inner, 1))
        else:
            self.net = torch.nn.Linear(width, 1)

    def forward(self, h: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        x = h.float()
        if self.config.draft_prob:
            if p is None:
                raise SpeculumError("this acceptance head also reads the draft's probability of its token (p)")
            x = torch.cat([x, torch.as_tensor(p, dtype=torch.float32, device=x.device).expand(x.shape[:-1])[..., None]],
                          -1)
        return self.net(x).squeeze(-1)

    def accept_prob(self, h: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        """``[...]`` predicted acceptance probabilities of the tokens drafted from ``h [..., D]``
        (``p [...]``: their draft probabilities, for a ``draft_prob`` head)."""
        return torch.sigmoid(self(h, p))


def save_acceptance_head(path: str | Path, head: AcceptanceHead, meta: dict) -> Path:
    """Write ``head`` (float32) to one safetensors file, with its config and ``meta`` in the header."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    header = {"kind": KIND, "config": json.dumps(head.config.to_dict()), "meta": json.dumps(meta)}
    save_file(tensors, str(path), metadata=header)
    return path


def load_acceptance_head(path: str | Path, hidden: int | None = None) -> tuple[AcceptanceHead, dict]:
    """``(head, meta)`` from a file of :func:`save_acceptance_head`; ``hidden``: the draft model's
    hidden size, checked against the head's."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise SpeculumError(f"acceptance head {path} does not exist (train one: python -m speculum.train.acceptance)")
    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    except Exception as e:  # a foreign or damaged file
        raise SpeculumError(f"{path} is not an acceptance head file ({e})") from e
    if header.get("kind") != KIND:
        raise SpeculumError(f"{path} is not an acceptance head file (its kind is {header.get('kind')!r})")
    head = AcceptanceHead(AcceptanceConfig(**json.loads(header["config"])))
    if hidden is not None and head.config.hidden != hidden:
        raise SpeculumError(f"acceptance head {path.name} reads hidden size {head.config.hidden}, "
                            f"the draft model's is {hidden}")
    head.load_state_dict(tensors)
    return head.eval().requires_grad_(False), json.loads(header.get("meta", "{}"))


def read_acceptance_meta(path: str | Path) -> dict:
    """The ``meta`` a head file was saved with (its training record), without loading the weights;
    {} for a file that is not an acceptance head."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
    except Exception:  # noqa: BLE001 - a foreign or damaged file: not a head to pick
        return {}
    return json.loads(header.get("meta", "{}")) if header.get("kind") == KIND else {}


def draft_fingerprint(model: torch.nn.Module) -> dict | None:
    """What tells one draft model's weights from another's: its layer count, hidden size and
    vocabulary, and the mean magnitude of its input embedding and of its last three norm weights
    (the last layer's and the final one), by name: tensors a runner never releases. None where
    they cannot be read. Magnitudes survive a change of dtype (float32 / bfloat16) but not another
    model or another layer count."""
    config = model.config.get_text_config()
    norms = [(n, p) for n, p in model.named_parameters() if n.endswith("norm.weight")]
    embed = model.get_input_embeddings()
    picked = [("embed", getattr(embed, "weight", None))] + norms[-3:]
    if any(t is None or t.numel() == 0 or t.is_meta for _, t in picked):
        return None
    return {"layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
            "weights": {name: float(t.detach().float().abs().mean()) for name, t in picked}}


def same_draft(recorded: dict | None, model: torch.nn.Module, rtol: float = 1e-3) -> bool:
    """Whether ``model`` is the draft whose :func:`draft_fingerprint` is ``recorded``."""
    mine = draft_fingerprint(model)
    if not recorded or mine is None:
        return False
    if any(recorded.get(k) != mine[k] for k in ("layers", "hidden", "vocab")):
        return False
    theirs = recorded.get("weights", {})
    return theirs.keys() == mine["weights"].keys() and all(
        abs(theirs[k] - v) <= rtol * abs(v) for k, v in mine["weights"].items())


def shipped_acceptance_head(target: torch.nn.Module, draft: torch.nn.Module) -> Path | None:
    """The shipped head trained for this (target, draft) pair, if any: a file of
    ``heads/weights/<target key>/acceptance*.safetensors`` whose recorded target is ``target``'s
    key and whose recorded draft fingerprint matches ``draft``."""
    key = target_key(target)
    if not key:
        return None
    for path in sorted((SHIPPED / key).glob(f"{KIND}*.safetensors")):
        meta = read_acceptance_meta(path)
        if meta.get("target") == key and same_draft(meta.get("draft_fingerprint"), draft):
            return path
    return None
