"""``kv_draft``'s DuoAttention, TidalDecode, TokenSelect and Double Sparsity views: greedy output equal to ``ar``'s (chains and
trees, tiny Llama and Gemma-3 past its window), the draft rows reading exactly what each view's
rule says (logits against attention under per-head masks over the whole cache, float32), and clear
refusals."""

import math
import random

import pytest
import torch
from conftest import TINY_VOCAB, batched_join_midway, tiny_gemma3, tiny_llama

from speculum.attention import attention_probs, grouped
from speculum.cache.store import FunctionStore
from speculum.drafters import DRAFTERS
from speculum.drafters.kv_draft import kv_draft_options
from speculum.drafting.duo_view import head_runs
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv.duo_attention import DuoGates
from speculum.kv.scoring import pool_scores
from speculum.methods import build_method
from speculum.runners import NativeRunner


def random_gates(model, seed: int = 0, sinks: int = 1, window: int = 4) -> DuoGates:
    """Gates for a tiny model (none ship for it): random on full-attention layers, NaN on sliding ones."""
    cfg = model.config
    alpha = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=torch.Generator().manual_seed(seed))
    for i, kind in enumerate(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers):
        if kind == "sliding_attention":
            alpha[i] = math.nan
    return DuoGates(alpha, sinks, window)


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(8, 30))] for _ in range(n)]


def view_options(policy: str, model) -> dict:
    if policy == "duo":
        return {"policy": "duo", "gates": random_gates(model), "retrieval": 50}
    if policy == "double_sparsity":
        return {"policy": policy, "sink": 1, "window": 4, "selected": 3, "observe": 4, "channels": 2}
    return {"policy": policy, "sink": 1, "window": 4, "selected": 3}


@pytest.mark.parametrize("policy", ["duo", "tidal", "tokenselect", "double_sparsity"])
@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("make", [lambda: tiny_llama(layers=4), tiny_gemma3], ids=["llama", "gemma3"])
def test_greedy_view_drafts_equal_ar(policy, top_k, make):
    model = make()
    ar = build_method("ar", model, None)
    method = build_method("kv_draft", model, None, sized=False, top_k=top_k, max_nodes=16, exit_confidence=0.0,
                          bits=4, **view_options(policy, model))
    accepted = 0
    for p in prompts(3):
        r = method.run(p, 40)
        assert r.tokens == ar.run(p, 40).tokens
        accepted += sum(s.accepted for s in r.steps)
    assert accepted > 0


@pytest.mark.parametrize("policy", ["duo", "tokenselect"])
def test_batched_view_drafts_equal_solo(policy):
    """Requests in one forward per step, joining mid-way, each drafting over its own pool slot with
    its own fork (tokenselect: its own Selection Cache)."""
    model = tiny_llama(layers=4)
    runner = NativeRunner(model)
    drafter = DRAFTERS["kv_draft"].factory(target=model, draft_head=None, top_k=1, exit_confidence=0.0,
                                           **view_options(policy, model))
    engine = Engine(runner, drafter, eos_token_ids=[])
    ar = build_method("ar", model, None, runner=runner)
    ps = prompts(2, n=4)
    assert batched_join_midway(runner, engine, ps) == [ar.run(p, 40).tokens for p in ps]


def _drafter_after_request(policy: str, **options):
    """A float32 tiny Llama's ``kv_draft`` drafter (the target's weights) after a request whose output
    equals ``ar``'s, its draft begun for 3 rows."""
    model = tiny_llama(layers=4)
    drafter = DRAFTERS["kv_draft"].factory(target=model, policy=policy, bits=16, **options)
    prompt = prompts(6, 1)[0] + list(range(20))
    out = Engine(NativeRunner(model), drafter, eos_token_ids=[]).generate(prompt, 12)
    assert out.tokens == build_method("ar", model, None).run(prompt, 12).tokens
    draft = drafter.model
    draft.begin(drafter.target_cache, 3)
    return draft


def _masked_reference(draft, ids: list[int], visible_of) -> torch.Tensor:
    """Logits ``[n, V]`` of rows ``ids`` after the committed entries (each row seeing the rows before
    it), every layer attending over all committed entries under the per-KV-head mask
    ``visible_of(i, q, keys, values, causal) -> [H_kv, n, L + n]`` bool."""
    dec, kv, length, n = draft.decoder, draft.cache.kv, draft.cache.length, len(ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def masked(i, sliding, q, k, v):
        keys = torch.cat([kv[i, 0, :, :length], k.transpose(0, 1)], dim=1)
        values = torch.cat([kv[i, 1, :, :length], v.transpose(0, 1)], dim=1)
        visible = visible_of(i, q, keys, values, causal)
        return dec.attend(q, keys, values, grouped(visible, dec.shape.group, dec.dtype))

    with torch.inference_mode():
        return dec.forward_with(torch.tensor(ids), torch.arange(length, length + n), FunctionStore(masked)).logits


def _draft_logits(draft, ids: list[int]) -> torch.Tensor:
    length, n = draft.cache.length, len(ids)
    return draft.run(torch.tensor(ids), torch.arange(length, length + n), torch.ones(n, n, dtype=torch.bool).tril())


def test_duo_view_streaming_heads_read_only_sinks_and_window():
    sinks, window = 2, 5
    model = tiny_llama(layers=4)
    gates = random_gates(model, seed=3, sinks=sinks, window=window)
    draft = _drafter_after_request("duo", gates=gates, retrieval=50)
    retrieval = draft.view.retrieval
    assert sum(len(r) for r in retrieval) == 4  # half of the 4 x 2 gated heads, the highest gates
    assert all(gates.alpha[i, h] >= gates.alpha[j, o] for i, r in enumerate(retrieval) for h in r
               for j in range(4) for o in range(2) if o not in retrieval[j])
    length = draft.cache.length
    assert length > sinks + window + 10

    def visible_of(i, q, keys, values, causal):
        pos = torch.arange(length)
        streaming = (pos < sinks) | (pos >= length - window)
        rows = [torch.cat([(torch.ones_like(pos, dtype=torch.bool) if h in retrieval[i] else streaming)
                           .expand(len(causal), -1), causal], dim=1) for h in range(2)]
        return torch.stack(rows)

    ids = [5, 9, 2]
    torch.testing.assert_close(_draft_logits(draft, ids), _masked_reference(draft, ids, visible_of), rtol=1e-5, atol=1e-5)


def test_head_runs_cover_the_heads_in_order():
    assert head_runs((0, 1, 4), 6) == [(0, 2, True), (2, 4, False), (4, 5, True), (5, 6, False)]
    assert head_runs((), 2) == [(0, 2, False)]


def test_tidal_view_reads_the_selection_layers_top_entries():
    """Layers 0 and 1 read everything; layer 1 picks per KV head the ``selected`` entries between the
    sinks and the window with the most attention from the draft rows (summed over rows and query heads,
    max-pooled over 7); layer 2 reads the sinks, those and the window; layer 3 picks again for itself."""
    sink, window, selected = 1, 4, 3
    draft = _drafter_after_request("tidal", sink=sink, window=window, selected=selected, layers=(1, 3))
    assert draft.view.tidal == (1, 3)
    length, s = draft.cache.length, draft.decoder.shape
    chosen = {}

    def visible_of(i, q, keys, values, causal):
        n = len(causal)
        everything = torch.cat([torch.ones(n, length, dtype=torch.bool), causal], dim=1).expand(s.kv_heads, -1, -1)
        if i in (1, 3):
            probs = attention_probs(q, keys, grouped(everything[0], s.group, torch.float32), s.attn_scale)
            scores = pool_scores(probs.sum(1)[:, sink:length - window], 7)
            chosen[i] = scores.topk(selected, dim=-1).indices + sink  # [H_kv, selected]
        if i != 2:
            return everything
        pos = torch.arange(length)
        base = (pos < sink) | (pos >= length - window)
        rows = []
        for h in range(s.kv_heads):
            mine = base.clone()
            mine[chosen[1][h]] = True
            rows.append(torch.cat([mine.expand(n, -1), causal], dim=1))
        return torch.stack(rows)

    ids = [5, 9, 2]
    got = _draft_logits(draft, ids)
    want = _masked_reference(draft, ids, visible_of)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(chosen) == {1, 3}


def test_tokenselect_view_reads_each_layers_most_voted_entries():
    """Layers 0 and 1 read everything; layers 2 and 3 each read the sinks, the window and the
    ``selected`` entries between them with the most head soft votes (each query head's softmax of raw
    q.k over the candidates, summed over heads and rows), the same for both KV heads; with
    ``threshold`` 0 the next forward reuses each layer's vote, with 101 it votes again."""
    sink, window, selected = 1, 4, 3
    draft = _drafter_after_request("tokenselect", sink=sink, window=window, selected=selected, threshold=101)
    length, s = draft.cache.length, draft.decoder.shape
    voted = {}

    def visible_of(i, q, keys, values, causal):
        n = len(causal)
        if i < 2:
            return torch.cat([torch.ones(n, length, dtype=torch.bool), causal], dim=1).expand(s.kv_heads, -1, -1)
        lo, hi = sink, length - window
        dots = torch.einsum("nhd,hcd->hnc", q.float().view(n, s.kv_heads, s.group, -1).flatten(1, 2),
                            keys[:, lo:hi].float().repeat_interleave(s.group, 0))  # [H, n, C]
        voted[i] = dots.softmax(-1).sum((0, 1)).topk(selected).indices + lo
        mine = (torch.arange(length) < sink) | (torch.arange(length) >= hi)
        mine[voted[i]] = True
        return torch.cat([mine.expand(n, -1), causal], dim=1).expand(s.kv_heads, -1, -1)

    ids = [5, 9, 2]
    got = _draft_logits(draft, ids)
    torch.testing.assert_close(got, _masked_reference(draft, ids, visible_of), rtol=1e-5, atol=1e-5)
    assert sorted(voted) == [2, 3]
    assert all(sorted(draft.votes.anchors[i].positions.tolist()) == sorted(voted[i].tolist()) for i in (2, 3))
    before = {i: a for i, a in draft.votes.anchors.items()}
    draft.begin(draft.cache, 1)
    draft.run(torch.tensor([7]), torch.tensor([length]), torch.ones(1, 1, dtype=torch.bool))
    assert all(draft.votes.anchors[i] is not before[i] for i in (2, 3))  # alike or not: 101 votes again
    draft.votes.threshold = 0.0
    before = {i: a for i, a in draft.votes.anchors.items()}
    draft.begin(draft.cache, 1)
    draft.run(torch.tensor([11]), torch.tensor([length]), torch.ones(1, 1, dtype=torch.bool))
    assert all(draft.votes.anchors[i] is before[i] for i in (2, 3))  # the Selection Cache: the last vote again


def test_double_sparsity_view_reads_the_label_channels_top_entries():
    """The label cache holds the committed keys' label channels from the sinks up to the window (as
    the prompt ended); every full-attention layer reads the sinks, everything since, and per KV head
    the ``selected`` entries with the most approximate attention over the label channels (each query
    head's softmax, summed over the KV head's query heads and the rows)."""
    sink, window, selected, channels = 1, 4, 3, 2
    draft = _drafter_after_request("double_sparsity", sink=sink, window=window, selected=selected, observe=4,
                                   channels=channels)
    length, s = draft.cache.length, draft.decoder.shape
    recent = draft.recent
    assert sorted(draft.labels) == [0, 1, 2, 3] and sink < recent < length - window
    chosen = {}

    def visible_of(i, q, keys, values, causal):
        ch, label_keys = draft.labels[i]  # [H_kv, r], [H_kv, B, r]
        assert ch.shape == (s.kv_heads, channels)
        rows = []
        for h in range(s.kv_heads):
            torch.testing.assert_close(label_keys[h], keys[h, sink:recent][:, ch[h]])
            qh = q[:, h * s.group:(h + 1) * s.group][..., ch[h]].float()  # [n, g, r]
            approx = torch.einsum("ngr,br->ngb", qh, keys[h, sink:recent][:, ch[h]].float()) * s.attn_scale
            top = approx.softmax(-1).sum((0, 1)).topk(selected).indices + sink
            mine = (torch.arange(length) < sink) | (torch.arange(length) >= recent)
            mine[top] = True
            chosen[(i, h)] = top
            rows.append(torch.cat([mine.expand(len(causal), -1), causal], dim=1))
        return torch.stack(rows)

    ids = [5, 9, 2]
    torch.testing.assert_close(_draft_logits(draft, ids), _masked_reference(draft, ids, visible_of), rtol=1e-5, atol=1e-5)
    assert len(chosen) == 4 * s.kv_heads


def test_view_options_and_refusals():
    model = tiny_llama(layers=4)
    assert kv_draft_options("duo:gates=g.json,retrieval=50") == {"policy": "duo", "gates": "g.json", "retrieval": 50}
    assert kv_draft_options("tidal:selected=64,dense=1") == {"policy": "tidal", "selected": 64, "dense": 1}
    with pytest.raises(SpeculumError, match="gates .* is the duo view"):
        kv_draft_options("tidal:gates=g.json")
    with pytest.raises(SpeculumError, match="none ship"):
        build_method("kv_draft", model, None, policy="duo")
    with pytest.raises(SpeculumError, match="do not fit"):
        build_method("kv_draft", model, None, policy="duo", gates=random_gates(tiny_llama(layers=2)))
    assert kv_draft_options("tokenselect:threshold=95") == {"policy": "tokenselect", "threshold": 95}
    with pytest.raises(SpeculumError, match="threshold in 0..101"):
        build_method("kv_draft", model, None, policy="tokenselect", threshold=-1)
    with pytest.raises(SpeculumError, match="channels >= 1"):
        build_method("kv_draft", model, None, policy="double_sparsity", channels=0)
    with pytest.raises(SpeculumError, match="retrieval in 0..100"):
        build_method("kv_draft", model, None, policy="duo", gates=random_gates(model), retrieval=101)
    with pytest.raises(SpeculumError, match="full-attention layers"):
        build_method("kv_draft", tiny_gemma3(), None, policy="tidal", layers=(0,))
