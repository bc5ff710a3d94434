"""The EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): one decoder layer that predicts the target's next *feature* (its final-norm hidden
state, what the LM head reads) from the current feature and the next token's embedding.

Pair ``t`` combines the target's feature ``f_t`` ``[D]`` (at token ``t``) with the embedding of token
``x_{t+1}``; the head maps it to ``f̂_{t+1}``, and the target's frozen LM head turns ``f̂_{t+1}`` into
the distribution of token ``x_{t+2}``. Pair ``t`` sits at rotary position ``t``. While drafting,
a drafted token's pair takes its parent's *predicted* feature in place of the target's.

Shapes: ``D`` the target's hidden size (also the head's), ``H`` / ``H_kv`` query / KV heads of the
head's attention, ``d`` its head dim, ``V`` the target's vocabulary, ``K`` the draft vocabulary
(``V``, or fewer with a trimmed LM head: FR-Spec / VocabTrim).

The module holds only the trained weights (``fc``, the layer); the target's embedding and LM head
are frozen tensors handed in by the caller (they are the target's own and are never saved here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.store import DraftBuffer, put
from ..runners.packed import fast_linear

LAYOUTS = ("speculum", "eagle1", "eagle3")


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape, saved beside its weights."""

    hidden: int  # D, the target's hidden size
    heads: int  # H
    kv_heads: int  # H_kv
    head_dim: int  # d
    intermediate: int  # the MLP's inner width
    rope_theta: float = 10000.0
    eps: float = 1e-6
    feature_layer: int = -1  # which target hidden state is the feature (-1: the final norm's output)
    # EAGLE-3: the committed tokens' input feature fuses these target layers' hidden states
    # (``fuse [len * D -> D]``); empty: the feature_layer's state as it is
    fuse_layers: tuple[int, ...] = ()
    # "speculum": ``fc`` with a bias and an input norm before attention; "eagle1": neither, the layout
    # of EAGLE-1's reference head and of vLLM's ``EagleLlamaForCausalLM`` (``speculum export-head``);
    # "eagle3": EAGLE-3's released layer (see :class:`EagleHead`), read by :mod:`~speculum.heads.published`
    layout: str = "speculum"
    fc_bias: bool | None = None  # ``fc``'s bias; None: the layout's (speculum: yes, eagle1: no)
    draft_vocab: int = 0  # eagle3: the rows ``K`` of the head's own LM head

    def __post_init__(self):
        object.__setattr__(self, "fuse_layers", tuple(self.fuse_layers))  # (a list, read back from JSON)
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown EAGLE head layout {self.layout!r}; choose from {', '.join(LAYOUTS)}")
        if self.layout == "eagle3" and not (self.fuse_layers and self.draft_vocab):
            raise ValueError("an eagle3 head fuses target layers (fuse_layers) and has its own LM head (draft_vocab)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, config, fuse_layers: tuple[int, ...] = (), layout: str = "speculum") -> EagleConfig:
        """A head sized like one decoder layer of the target (transformers ``config``)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", heads),
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   intermediate=cfg.intermediate_size, rope_theta=float(getattr(cfg, "rope_theta", 10000.0) or 10000.0),
                   eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), fuse_layers=tuple(fuse_layers), layout=layout)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split convention) of ``x [..., n, d]`` with ``cos, sin [n, d]``."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class AttentionHead(nn.Module):
    """What the heads with one attention block share (EAGLE's layer, Kangaroo's adapter): the
    ``input_norm`` and ``q``, ``k``, ``v``, ``o`` projections of a config with ``hidden``, ``heads``,
    ``kv_heads``, ``head_dim``, ``rope_theta`` and ``eps``, and rotary positions."""

    def __init__(self, c, width: int | None = None):
        super().__init__()
        self.config = c
        self.input_norm = RMSNorm(c.hidden, c.eps)
        width = width or c.hidden  # the attention's input width
        self.q = nn.Linear(width, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(width, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(width, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``cos, sin [n, d]``."""
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    @staticmethod
    def fast(*weights: torch.Tensor, bias: torch.Tensor | None = None, quantized: bool = False):
        """A drafting-time product with ``weights`` stacked (:func:`~speculum.runners.packed.fast_linear`;
        ``quantized``: on Q8_0 copies)."""
        return fast_linear(torch.cat([w.detach() for w in weights]), bias, quantized)


class EagleHead(AttentionHead):
    """``fc`` (``2D -> D``) then one Llama-style decoder layer; output the predicted feature ``[.., D]``.
    In the ``eagle1`` layout ``fc`` has no bias (unless ``fc_bias``) and the layer no input norm.

    The ``eagle3`` layout is EAGLE-3's released layer (SafeAILab's ``midlayer``, vLLM's
    ``Eagle3LlamaForCausalLM``): ``fuse`` (its ``fc``, ``3D -> D``, on the raw target states) makes the
    committed tokens' features; there is no ``fc`` of the pair: the attention reads
    ``[input_norm(embedding); hidden_norm(feature)]`` ``[.., 2D]`` and the residual stream starts at the
    feature. The output ``[.., D]`` is the head's own hidden state, fed back as a drafted token's feature
    and read through the head's own ``norm`` and ``lm_head`` ``[K, D]`` (:meth:`own_tables`), whose
    row ``i`` is target token ``i + d2t[i]``."""

    def __init__(self, config: EagleConfig):
        c = config
        eagle3 = c.layout == "eagle3"
        super().__init__(config, 2 * c.hidden if eagle3 else None)
        if eagle3:
            self.hidden_norm = RMSNorm(c.hidden, c.eps)
            self.norm = RMSNorm(c.hidden, c.eps)
            self.lm_head = nn.Linear(c.hidden, c.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab, dtype=torch.long))  # [K] target id - row
        else:
            bias = c.layout == "speculum" if c.fc_bias is None else c.fc_bias
            self.fc = nn.Linear(2 * c.hidden, c.hidden, bias=bias)
        self.normed_input = c.layout == "speculum"
        self.post_norm = RMSNorm(c.hidden, c.eps)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)
        if c.fuse_layers:
            self.fuse = nn.Linear(len(c.fuse_layers) * c.hidden, c.hidden, bias=False)

    def normalized_states(self, states: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fused layers' states ``[..., len(fuse_layers) * D]``, each layer's RMS-normalised
        (residual streams of middle layers carry a few huge channels); others as they are."""
        c = self.config
        if not c.fuse_layers or c.layout == "eagle3":  # (EAGLE-3's fc reads the raw states)
            return states
        parts = states.unflatten(-1, (len(c.fuse_layers), c.hidden))
        return F.rms_norm(parts, (c.hidden,), eps=c.eps).flatten(-2)

    def input_features(self, states: torch.Tensor) -> torch.Tensor:
        """Normalised states (:meth:`normalized_states`) -> the head's input features ``[..., D]``: EAGLE-3's
        fusion, or the feature layer's ``[..., D]`` as it is."""
        return self.fuse(states) if self.config.fuse_layers else states

    def _qkv(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """``feats, embeds [..., n, D]`` -> the residual ``[..., n, D]`` and roped ``q [..., H, n, d]``,
        ``k, v [..., H_kv, n, d]``."""
        c = self.config
        h, x = self._attention_input(feats, embeds, getattr(self, "fc", None))
        lead = x.shape[:-1]
        q = self.q(x).view(*lead, c.heads, c.head_dim).transpose(-2, -3)
        k = self.k(x).view(*lead, c.kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v(x).view(*lead, c.kv_heads, c.head_dim).transpose(-2, -3)
        cos, sin = self.rope(positions, x.dtype)
        return h, _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _attention_input(self, feats: torch.Tensor, embeds: torch.Tensor, fc) -> tuple[torch.Tensor, torch.Tensor]:
        """``feats, embeds [..., D]`` -> the residual stream ``[..., D]`` and the attention's input
        (``[..., D]``; ``eagle3``: ``[..., 2D]``), ``fc`` being :attr:`fc` or its drafting-time product."""
        if self.config.layout == "eagle3":
            return feats, torch.cat((self.input_norm(embeds), self.hidden_norm(feats)), dim=-1)
        h = fc(torch.cat((embeds, feats), dim=-1))
        if not self.normed_input:
            return h, h
        return h, F.rms_norm(h, (self.config.hidden,), self.input_norm.weight, self.config.eps)

    def own_tables(self, tables):
        """``eagle3``: the target's :class:`~speculum.heads.TargetTables` (its embedding) drafting
        through this head's ``norm`` and ``lm_head`` ``[K, D]`` over target ids ``arange(K) + d2t``
        (no soft-capping, no quantized rows); other layouts draft through the target's LM head."""
        if self.config.layout != "eagle3":
            return tables
        from dataclasses import replace

        ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
        return replace(tables, head=self.lm_head.weight.detach(), vocab=ids, softcap=None, quantized=None,
                       prenorm=self.norm)

    def _finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, output projection and MLP: ``h [..., n, D]``, ``attn [..., H, n, d]`` -> ``[..., n, D]``."""
        a = attn.transpose(-2, -3).flatten(-2)
        h = h + self.o(a)
        x = self.post_norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Training / teacher forcing: ``feats, embeds [B, T, D]`` (pair ``t`` at position ``t``, causal)
        -> predicted features ``[B, T, D]``."""
        positions = torch.arange(feats.shape[-2], device=feats.device)
        h, q, k, v = self._qkv(feats, embeds, positions)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self._finish(h, attn)

    def freeze(self, quantized: bool = False) -> EagleHead:
        """Ready for drafting: q/k/v and gate/up fused into one product each, prepacked for oneDNN
        on a CPU where that applies (:func:`~speculum.runners.packed.packed_linear`), or with
        ``quantized`` on Q8_0 copies through the quantized-weight kernels. Call again after the
        weights change."""
        def fast(*weights, bias=None):
            return self.fast(*weights, bias=bias, quantized=quantized)

        self._fast = {
            "qkv": fast(self.q.weight, self.k.weight, self.v.weight),
            "o": fast(self.o.weight),
            "gate_up": fast(self.gate.weight, self.up.weight),
            "down": fast(self.down.weight),
        }
        if hasattr(self, "fc"):
            self._fast["fc"] = fast(self.fc.weight, bias=self.fc.bias)
        if self.config.fuse_layers:
            self._fast["fuse"] = fast(self.fuse.weight)
        return self

    def drafting_features(self, states: torch.Tensor) -> torch.Tensor:
        """:meth:`input_features` while drafting (after :meth:`freeze`): the target's hidden states of
        the fused layers ``[n, len(fuse_layers) * D]`` -> ``[n, D]``; others as they are."""
        if not self.config.fuse_layers:
            return states
        return self._fast["fuse"](self.normalized_states(states))

    def step(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
             visible: torch.Tensor) -> torch.Tensor:
        """Drafting (after :meth:`freeze`): ``n`` pairs (``feats, embeds [n, D]`` at ``positions [n]``)
        written to ``cache``'s slots ``cache.used .. cache.used + n - 1``; row ``i`` attends the slots
        where ``visible [n, cache.used + n]`` is True. Returns predicted features ``[n, D]``, the
        same function as :meth:`forward`'s."""
        return self._drafting_layer(feats, embeds, positions,
                                    lambda qkv, rope: cached_attention(qkv, self.config, rope, cache, visible))

    def step_static(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                    slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """:meth:`step` in fixed shapes, with nothing read back to the host (what a CUDA graph can
        capture): ``n`` pairs written to the cache buffer ``kv [2, H_kv, C, d]`` at ``slots [n]`` (a
        tensor); row ``i`` attends the first ``Kb`` slots where ``visible [n, Kb]`` holds. Returns
        predicted features ``[n, D]``."""
        return self._drafting_layer(feats, embeds, positions,
                                    lambda qkv, rope: static_attention(qkv, self.config, rope, kv, slots, visible))

    def _drafting_layer(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend):
        """The drafting-time layer around ``attend(qkv [n, (H + 2 H_kv) d], (cos, sin)) -> [n, H d]``."""
        c, fast = self.config, self._fast
        h, x = self._attention_input(feats, embeds, fast.get("fc"))
        qkv = fast["qkv"](x)
        h = h + fast["o"](attend(qkv, self.rope(positions, h.dtype)))
        gate, up = fast["gate_up"](F.rms_norm(h, (c.hidden,), self.post_norm.weight, c.eps)).chunk(2, dim=-1)
        return h + fast["down"](F.silu(gate) * up)


def _roped_heads(qkv: torch.Tensor, c: EagleConfig, rope: tuple[torch.Tensor, torch.Tensor]):
    """Projected rows ``qkv [n, (H + 2 H_kv) d]`` -> ``q [H, n, d]``, ``k, v [H_kv, n, d]``, q and k roped."""
    n = qkv.shape[0]
    q, k, v = qkv.view(n, c.heads + 2 * c.kv_heads, c.head_dim).transpose(0, 1).split((c.heads, c.kv_heads, c.kv_heads))
    return _rotate(q, *rope), _rotate(k, *rope), v


def cached_attention(qkv: torch.Tensor, c: EagleConfig, rope: tuple[torch.Tensor, torch.Tensor], cache: HeadCache,
                     visible: torch.Tensor) -> torch.Tensor:
    """A head's attention while drafting: ``qkv [n, (H + 2 H_kv) d]`` projected rows, roped with
    ``rope`` (``cos, sin [n, d]``); their keys and values go to ``cache``'s slots ``cache.used ..
    cache.used + n - 1`` and row ``i`` attends the slots where ``visible [n, cache.used + n]`` holds.
    Returns ``[n, H d]``."""
    n = qkv.shape[0]
    q, k, v = _roped_heads(qkv, c, rope)
    keys = cache.append(0, k.transpose(0, 1), v.transpose(0, 1))
    cache.advance(n)
    attn = F.scaled_dot_product_attention(q, cache.k[:, :keys], cache.v[:, :keys], attn_mask=visible,
                                          enable_gqa=True)
    return attn.transpose(0, 1).reshape(n, c.heads * c.head_dim)


def static_attention(qkv: torch.Tensor, c: EagleConfig, rope: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor,
                     slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """:func:`cached_attention` in fixed shapes: the rows' keys and values go to ``slots [n]`` of
    ``kv [2, H_kv, C, d]`` and row ``i`` attends the first ``Kb`` slots where ``visible [n, Kb]``
    holds. Returns ``[n, H d]``."""
    n = qkv.shape[0]
    q, k, v = _roped_heads(qkv, c, rope)
    put(kv, slots, k.transpose(0, 1), v.transpose(0, 1))
    kb = visible.shape[1]
    attn = F.scaled_dot_product_attention(q, kv[0, :, :kb], kv[1, :, :kb], attn_mask=visible, enable_gqa=True)
    return attn.transpose(0, 1).reshape(n, c.heads * c.head_dim)


class HeadCache(DraftBuffer):
    """The head's keys and values (:class:`~speculum.cache.store.DraftBuffer`, one layer), ``k, v
    [H_kv, C, d]``: ``committed`` pairs first, then ``used - committed`` pending entries (this step's
    drafted nodes), dropped by :meth:`rollback`."""

    def __init__(self, config: EagleConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        super().__init__(1, config.kv_heads, config.head_dim, capacity, dtype, device)

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[0, 1]
