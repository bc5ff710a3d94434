"""Published heads in their released layouts (EAGLE-1/2, EAGLE-3, Medusa), loaded from a directory
or a hub id as ``--draft-head`` takes them: each computes what the reference architecture computes
(an independent implementation here, written from the papers' reference code), drafts what that
reference drafts, and keeps greedy output equal to ``ar``'s; a directory of no known layout is refused."""

import json
import random

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama

from speculum.cli.common import head_files
from speculum.errors import SpeculumError
from speculum.heads import HeadCache, head_for_target, head_kind, load_head
from speculum.methods import build_method

D, H, HKV, HD, FF, EPS, THETA = 64, 4, 2, 16, 128, 1e-6, 10000.0
K3 = 48  # the EAGLE-3 head's draft vocabulary


# --- the reference: plain tensor code after SafeAILab/EAGLE's cnets and FasterDecoding/medusa ---

def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, pos):
    """``x [T, heads, d]`` at positions ``pos [T]``, rotate-half convention."""
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2).float() / HD))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), -1) * sin


def attention(x, w, prefix):
    """Causal self-attention of ``x [T, in]`` with ``w[prefix + q_proj.weight]`` etc.; ``[T, D]``."""
    t = x.shape[0]
    pos = torch.arange(t)
    q = rope((x @ w[prefix + "q_proj.weight"].T).view(t, H, HD), pos)
    k = rope((x @ w[prefix + "k_proj.weight"].T).view(t, HKV, HD), pos).repeat_interleave(H // HKV, 1)
    v = (x @ w[prefix + "v_proj.weight"].T).view(t, HKV, HD).repeat_interleave(H // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HD ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, H * HD)
    return out @ w[prefix + "o_proj.weight"].T


def mlp(x, w, prefix):
    gate, up = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def eagle1_reference(w, feats, embeds):
    """EAGLE-1's ``Model.forward``: ``fc(cat(embeds, feats))``, layer 0 without an input norm."""
    h = torch.cat((embeds, feats), -1) @ w["fc.weight"].T + w["fc.bias"]
    h = h + attention(h, w, "layers.0.self_attn.")
    return h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")


def eagle3_reference(w, states, embeds):
    """EAGLE-3's ``Model.forward`` from the target's fused states ``[T, 3D]``: the midlayer's output
    ``[T, D]`` and its draft logits over the target's vocabulary (``-inf`` outside ``d2t``'s)."""
    h = states @ w["fc.weight"].T
    x = torch.cat((rms(embeds, w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])), -1)
    h = h + attention(x, w, "midlayer.self_attn.")
    h = h + mlp(rms(h, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.mlp.")
    draft = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T  # [T, K]
    full = torch.full((h.shape[0], TINY_VOCAB), float("-inf"))
    full[:, torch.arange(K3) + w["d2t"]] = draft
    return h, full


def medusa_reference(w, feat, heads, layers):
    """Every Medusa head's logits ``[heads, V]`` on the feature ``feat [D]``."""
    out = []
    for i in range(heads):
        x = feat
        for j in range(layers):
            x = x + torch.nn.functional.silu(x @ w[f"{i}.{j}.linear.weight"].T + w[f"{i}.{j}.linear.bias"])
        out.append(x @ w[f"{i}.{layers}.weight"].T)
    return torch.stack(out)


# --- checkpoints in the released layouts ---

def _rand(*shape, scale=1.0):
    return torch.randn(*shape) * scale / (shape[-1] ** 0.5 if len(shape) > 1 else 1.0)


def _layer(prefix, width):
    w = {prefix + f"self_attn.{n}_proj.weight": _rand(rows, width) for n, rows in
         (("q", H * HD), ("k", HKV * HD), ("v", HKV * HD))}
    w[prefix + "self_attn.o_proj.weight"] = _rand(D, H * HD)
    w |= {prefix + f"mlp.{n}_proj.weight": _rand(FF, D) for n in ("gate", "up")}
    w[prefix + "mlp.down_proj.weight"] = _rand(D, FF, scale=8.0)  # sharp: the drafts differ from plain choices
    w[prefix + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(D)
    return w


def _config(**extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
            "num_attention_heads": H, "num_key_value_heads": HKV, "intermediate_size": FF, "rms_norm_eps": EPS,
            "rope_theta": THETA, "vocab_size": TINY_VOCAB, "num_hidden_layers": 1, **extra}


def eagle1_dir(path, seed=0, **config):
    """EAGLE-1/2's release: ``pytorch_model.bin`` (with the embedding the reference stores, unread)."""
    torch.manual_seed(seed)
    w = {"fc.weight": _rand(D, 2 * D), "fc.bias": 0.1 * torch.randn(D), "embed_tokens.weight": torch.randn(TINY_VOCAB, D)}
    w |= _layer("layers.0.", D)
    path.mkdir()
    torch.save({k: v.half() for k, v in w.items()}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(_config(bias=True, **config)))
    return {k: v.half().float() for k, v in w.items()}


def eagle3_dir(path, seed=0, **config):
    """EAGLE-3's release: ``model.safetensors`` with a draft vocabulary of ``K3`` of the target's tokens."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    ids = torch.randperm(TINY_VOCAB)[:K3].sort().values
    w = {"fc.weight": _rand(D, 3 * D), "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(D),
         "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(D), "norm.weight": 1 + 0.1 * torch.randn(D),
         "lm_head.weight": _rand(K3, D, scale=4.0)}
    w |= _layer("midlayer.", 2 * D)
    path.mkdir()
    save_file({k: v.bfloat16() for k, v in w.items()} | {"d2t": ids - torch.arange(K3),
                                                         "t2d": torch.isin(torch.arange(TINY_VOCAB), ids)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(_config(architectures=["LlamaForCausalLMEagle3"],
                                                         draft_vocab_size=K3, **config)))
    return {k: v.bfloat16().float() for k, v in w.items()} | {"d2t": ids - torch.arange(K3)}


def medusa_dir(path, seed=0, heads=3, layers=2):
    """Medusa's release: ``medusa_lm_head.safetensors``, each head's blocks and own LM head."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    w = {}
    for i in range(heads):
        for j in range(layers):
            w[f"{i}.{j}.linear.weight"], w[f"{i}.{j}.linear.bias"] = _rand(D, D, scale=2.0), 0.1 * torch.randn(D)
        w[f"{i}.{layers}.weight"] = _rand(TINY_VOCAB, D, scale=4.0)
    path.mkdir()
    save_file(w, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": "tiny"}))
    return w


L3 = 8  # the EAGLE-3 target's layers: the reference's fused layers (2, L // 2, L - 3) are distinct


def target_for(layout):
    return tiny_llama(layers=L3 if layout == "eagle3" else 2)


def make(layout, path, **config):
    return {"eagle1": eagle1_dir, "eagle3": eagle3_dir, "medusa": medusa_dir}[layout](path, **config)


def hidden_states(model, ids):
    """``{j: [T, D]}``: the input of target layer ``j`` (``L``: the final norm's output), and the logits."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return {j: h[0] for j, h in enumerate(out.hidden_states)}, out.logits[0]


# --- tests ---

@torch.no_grad()
def test_eagle1_layer_is_the_reference(tmp_path):
    model = target_for("eagle1")
    w = eagle1_dir(tmp_path / "eagle1")
    head, tables, _ = head_for_target(model, "eagle", head_files(str(tmp_path / "eagle1")))
    assert head.config.layout == "eagle1" and head.config.fc_bias
    feats, embeds = torch.randn(7, D), torch.randn(7, D)
    want = eagle1_reference(w, feats, embeds)
    torch.testing.assert_close(head(feats[None], embeds[None])[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_drafting(head, feats, embeds), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tables.logits(want), want @ model.lm_head.weight.T)  # the target's LM head


@pytest.mark.parametrize("named", [False, True], ids=["default_layers", "named_layers"])
@torch.no_grad()
def test_eagle3_midlayer_is_the_reference(named, tmp_path):
    model = target_for("eagle3")
    layers = [1, 3, 6] if named else [2, L3 // 2, L3 - 3]
    w = eagle3_dir(tmp_path / "eagle3", **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}} if named else {}))
    head, tables, _ = head_for_target(model, "eagle", str(tmp_path / "eagle3"))
    assert head.config.layout == "eagle3" and head.config.fuse_layers == tuple(layers)
    states, embeds = torch.randn(7, 3 * D) * 3, torch.randn(7, D)
    want, want_logits = eagle3_reference(w, states, embeds)
    feats = head.drafting_features(states)  # EAGLE-3's fc on the raw states
    torch.testing.assert_close(head(feats[None], embeds[None])[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_drafting(head, feats, embeds), want, rtol=1e-4, atol=1e-4)
    got = tables.full_logits(tables.logits(want), TINY_VOCAB)  # its own norm, LM head and d2t
    torch.testing.assert_close(got, want_logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_medusa_heads_are_the_reference(tmp_path):
    model = target_for("medusa")
    w = medusa_dir(tmp_path / "medusa", heads=3, layers=2)
    assert head_kind(tmp_path / "medusa") == "medusa"
    head, tables, _ = head_for_target(model, "medusa", (str(tmp_path / "medusa"),))
    assert (head.config.num_heads, head.config.layers, head.config.vocab) == (3, 2, TINY_VOCAB)
    feat = torch.randn(D)
    torch.testing.assert_close(head.draft_logits(feat, tables), medusa_reference(w, feat, 3, 2), rtol=1e-4, atol=1e-4)


def _drafting(head, feats, embeds):
    """The drafting-time path (:meth:`EagleHead.step` over a head cache, causal) on ``[T, D]`` pairs."""
    t = feats.shape[0]
    cache = HeadCache(head.config, t, feats.dtype, feats.device)
    return head.step(feats, embeds, torch.arange(t), cache, torch.ones(t, t, dtype=torch.bool).tril())


def prompts(seed, n=3):
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(n)]


@pytest.mark.parametrize("layout", ["eagle1", "eagle3", "medusa"])
@torch.no_grad()
def test_first_draft_is_the_references(layout, tmp_path):
    """The drafter's tree under the target's first token (its ``top_k`` children) is the reference's
    top ``k`` on the prompt: the target's states reach the head as the reference feeds them."""
    model = target_for(layout)
    w = make(layout, tmp_path / layout)
    kind = "medusa" if layout == "medusa" else "eagle"
    method = build_method(kind, model, None, draft_head=(str(tmp_path / layout),), top_k=4, max_nodes=4,
                          sized=False, **({} if kind == "medusa" else {"depth": 1, "lookup": 0}))
    drafter = method.engine.drafter
    drafter.depth = 1
    trees, propose = {}, drafter.propose
    drafter.propose = lambda tokens, budget: trees.setdefault(tuple(tokens), propose(tokens, budget))
    ids = prompts(5, 1)[0]
    method.run(ids, 8)
    hidden, logits = hidden_states(model, ids)
    root = int(logits[-1].argmax())
    embeds = model.model.embed_tokens(torch.tensor(ids[1:] + [root]))
    if layout == "eagle1":
        want = eagle1_reference(w, hidden[2], embeds)[-1] @ model.lm_head.weight.T
    elif layout == "eagle3":
        want = eagle3_reference(w, torch.cat([hidden[j] for j in (2, L3 // 2, L3 - 3)], -1), embeds)[1][-1]
    else:
        want = medusa_reference(w, hidden[2][-1], 3, 2)[0]
    first = trees[(*ids, root)]  # the step after the prompt's: its root the target's first token
    assert sorted(first.tokens) == sorted(want.topk(4).indices.tolist())
    assert all(p == -1 for p in first.parents)


@pytest.mark.parametrize("case", ["eagle1", "eagle3", "eagle3_device_tree", "medusa"])
def test_greedy_with_published_heads_equals_ar(case, tmp_path):
    """Lossless; ``device_tree``: EAGLE-2's fixed-shape growth (eager here, CUDA graphs on a GPU)."""
    layout, _, variant = case.partition("_")
    model = target_for(layout)
    make(layout, tmp_path / layout)
    kind = "medusa" if layout == "medusa" else "eagle"
    ar = build_method("ar", model, None)
    options = {"device_tree": True} if variant else {}
    method = build_method(kind, model, None, draft_head=(str(tmp_path / layout),), top_k=3, max_nodes=12,
                          sized=False, **options)
    assert getattr(method.engine.drafter, "device_tree", False) == bool(variant)
    drafted = 0
    for p in prompts(1):
        got = method.run(p, 32)
        assert got.tokens == ar.run(p, 32).tokens
        drafted += sum(s.drafted for s in got.steps)
    assert drafted > 0


def test_hub_id_downloads_the_released_files(tmp_path, monkeypatch):
    """A hub id that is no path here goes to ``huggingface_hub.snapshot_download`` (config and
    weights only); a failed download is a :class:`SpeculumError`."""
    import huggingface_hub

    model = target_for("eagle1")
    eagle1_dir(tmp_path / "snapshot")
    asked = []
    monkeypatch.chdir(tmp_path)

    def snapshot(repo, allow_patterns):
        asked.append((repo, allow_patterns))
        if repo != "someone/EAGLE-tiny":
            raise OSError("offline")
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert head_kind("someone/EAGLE-tiny") == "eagle"
    assert load_head("someone/EAGLE-tiny", model).module.config.layout == "eagle1"
    assert asked[0][0] == "someone/EAGLE-tiny" and "config.json" in asked[0][1]
    with pytest.raises(SpeculumError, match="downloading it from the Hugging Face hub failed.*offline"):
        build_method("eagle", model, None, draft_head=("someone/no-such-head",))


def test_bad_directories_are_refused(tmp_path):
    model = target_for("eagle1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculumError, match="no draft head speculum knows"):
        build_method("eagle", model, None, draft_head=(str(tmp_path / "empty"),))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpeculumError, match="cannot read"):
        head_kind(tmp_path / "junk")
    eagle1_dir(tmp_path / "wide", vocab_size=2 * TINY_VOCAB)  # made for another target
    with pytest.raises(SpeculumError, match="vocabulary of 192"):
        build_method("eagle", model, None, draft_head=(str(tmp_path / "wide"),))
    eagle1_dir(tmp_path / "scaled", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(SpeculumError, match="RoPE scaling"):
        load_head(tmp_path / "scaled", model)
    eagle3_dir(tmp_path / "eagle3")  # names no fused layers, and a 2-layer target has no layer L - 3
    with pytest.raises(SpeculumError, match="hidden-state layers"):
        build_method("eagle", model, None, draft_head=(str(tmp_path / "eagle3"),)).run([1, 2, 3], 4)
    medusa_dir(tmp_path / "medusa")
    with pytest.raises(SpeculumError, match="no eagle head"):
        build_method("eagle", model, None, draft_head=(str(tmp_path / "medusa"),))
