"""Budget-allocation KV policies (PyramidKV, CAKE, Ada-KV) and the ragged cache they store into.

- RaggedKVCache: per-layer buffers at each layer's size, ragged heads padded and masked out of
  attention, the pending/commit protocol at each layer's own offset, rollback bounded by the prompt
  entries, the sliding-window rule on each slot's position.
- Each policy's rule on a constructed example: PyramidKV's linear shares, CAKE's preferences and
  cascade, Ada-KV's joint top-k with its alpha floor; every one keeps a uniform budget's total.
- Selection at prefill only, then appends: every drafter equals ``ar`` under the policy with a lossy
  budget, and ``ar`` without a policy with a covering one (tiny Llama and Gemma-3).
"""

import math

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama
from kv_lossless import ar_tokens, assert_drafters_equal_ar, lookup_prompt

from speculum.attention import AttentionLayout, Step
from speculum.cache import RaggedKVCache
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.kv.adakv import head_counts
from speculum.kv.budgets import apportion
from speculum.kv.cake import indicator, preference
from speculum.kv.pyramidkv import pyramid
from speculum.runners import runner_for, under_policy

SPECS = ["pyramidkv:window=4", "cake:window=4", "adakv:window=4"]  # a window under the lossy budget of 12


def _layout(layers=2, window=None, sliding=()):
    return AttentionLayout(layers=layers, heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5, window=window,
                           sliding=tuple(sliding))


def _reference(q, keys, values, visible, scale):
    """Attention of ``q [n, H, d]`` with per (row, KV head) key lists: ``keys[h]``, ``values[h] [L_h, d]``,
    ``visible[h] [n, L_h]`` bool -> ``[n, H, d]``."""
    heads = q.shape[1]
    g = heads // len(keys)
    out = torch.empty_like(q)
    for j in range(heads):
        h = j // g
        logits = (q[:, j] @ keys[h].T) * scale
        out[:, j] = logits.masked_fill(~visible[h], float("-inf")).softmax(-1) @ values[h]
    return out


@torch.inference_mode()
def test_ragged_cache_heads_layers_commit_rollback():
    torch.manual_seed(0)
    s = _layout()
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=9)
    prompt = torch.randn(2, 2, 6, 8)  # [2, H_kv, n, d]
    cache.plan(6, room=1)
    rows = [torch.tensor([0, 2, 5]), torch.tensor([4])]
    cache.store_layer(0, prompt, rows)  # ragged heads: 3 and 1 entries, padded to 3
    cache.store_layer(1, prompt, None)
    cache.end_prefill()
    slot = 2 * 2 * 8 * 4
    assert cache.prefix == [3, 6] and cache.lag == [3, 0] and cache.length == 6 and cache.position == 6
    assert cache.counts.tolist() == [[3, 1], [6, 6]] and cache.kept() == 16
    assert cache.nbytes() == (3 + 6) * slot  # the padded slots of head 1 counted
    assert [kv.shape[2] for kv in cache.kv] == [3 + 1, 6 + 1]  # each layer at its own size

    # a tree step: root at 6, two children a, b at 7 (room grows from 1 to 3)
    step = Step(torch.tensor([6, 7, 7]), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
    cache.begin(step.positions)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    out = cache.attend_all(0, False, q, k, v, step).view(3, 4, 8)
    keys = [torch.cat([prompt[0, h, rows[h]], k[:, h]]) for h in range(2)]
    values = [torch.cat([prompt[1, h, rows[h]], v[:, h]]) for h in range(2)]
    visible = [torch.cat([torch.ones(3, len(rows[h]), dtype=torch.bool), step.new_mask], dim=1) for h in range(2)]
    torch.testing.assert_close(out, _reference(q, keys, values, visible, s.scale))
    cache.attend_all(1, False, q, k, v, step)
    cache.pending = 3

    cache.commit([0, 2])  # root and b
    assert cache.length == 8 and cache.position == 8 and cache.width(0) == 5 and cache.width(1) == 8
    for layer, at in ((0, 3), (1, 6)):
        torch.testing.assert_close(cache.kv[layer][0, :, at:at + 2], k[[0, 2]].transpose(0, 1))
        torch.testing.assert_close(cache.kv[layer][1, :, at:at + 2], v[[0, 2]].transpose(0, 1))
        assert cache.pos[layer][:, at:at + 2].tolist() == [[6, 7], [6, 7]]
    assert cache.pos[0][1, :3].tolist() == [4, -1, -1]  # head 1's padding
    with pytest.raises(ValueError):
        cache.rollback(5)  # into the selected prompt entries
    cache.rollback(7)
    assert cache.width(0) == 4 and cache.position == 7


@torch.inference_mode()
def test_ragged_cache_sliding_window_reads_slot_positions():
    torch.manual_seed(1)
    s = _layout(layers=1, window=3, sliding=(True,))
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=8)
    prompt = torch.randn(2, 2, 6, 8)
    cache.plan(6, room=2)
    cache.store_layer(0, prompt, torch.tensor([[1, 4, 5], [3, 4, 5]]))
    cache.end_prefill()
    step = Step(torch.tensor([6]), None)
    cache.begin(step.positions)
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    out = cache.attend_all(0, True, q, k, v, step).view(1, 4, 8)
    # the window sees positions 4, 5 and 6: slot 0 (position 1 or 3) is hidden in both heads
    keys = [torch.cat([prompt[0, h, 4:6], k[:, h]]) for h in range(2)]
    values = [torch.cat([prompt[1, h, 4:6], v[:, h]]) for h in range(2)]
    torch.testing.assert_close(out, _reference(q, keys, values, [torch.ones(1, 3, dtype=torch.bool)] * 2, s.scale))


@torch.inference_mode()
def test_ragged_cache_sliding_layer_reads_from_its_window():
    """A sliding layer that kept selected positions starts reading at the first slot any head holds
    inside the window (not at slot 0), and masks what a head holds before it."""
    torch.manual_seed(2)
    s = _layout(layers=1, window=3, sliding=(True,))
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=10)
    prompt = torch.randn(2, 2, 8, 8)
    cache.plan(8, room=2)
    kept = [[0, 2, 5, 6, 7], [1, 3, 4, 5, 7]]
    cache.store_layer(0, prompt, torch.tensor(kept))
    cache.end_prefill()
    step = Step(torch.tensor([8, 9]), torch.ones(2, 2, dtype=torch.bool).tril())
    cache.begin(step.positions)
    # the window holds positions 6.. for these rows: from slot 3 in head 0, slot 4 in head 1
    assert cache.visible(0, True, step)[0] == 3
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    out = cache.attend_all(0, True, q, k, v, step).view(2, 4, 8)
    keys = [torch.cat([prompt[0, h, kept[h]], k[:, h]]) for h in range(2)]
    values = [torch.cat([prompt[1, h, kept[h]], v[:, h]]) for h in range(2)]
    held = [torch.tensor([*row, 8, 9]) for row in kept]
    visible = [(p[None, :] > step.positions[:, None] - 3) & (p[None, :] <= step.positions[:, None]) for p in held]
    torch.testing.assert_close(out, _reference(q, keys, values, visible, s.scale))


def test_apportion():
    assert apportion([3, 1], 8, 5) == [5, 3]  # 6 capped at 5, the spare to the other
    assert apportion([1, 1, 1], 10, 100) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert apportion([0, 0], 6, 10) == [3, 3]
    assert apportion([1, float("nan"), 2], 9, 100) == [3, 0, 6]
    assert apportion([5, 1], 100, 10) == [10, 10]  # no more than the caps hold
    for weights in ([0.3, 2.2, 1.7, 0.01], [1e-9, 1, 1, 1]):
        shares = apportion(weights, 23, 9)
        assert sum(shares) == 23 and max(shares) <= 9


def test_pyramidkv_shares_fall_linearly():
    assert pyramid(4, 32, 1000, 4) == [56, 40, 24, 8]  # the module docstring's example
    assert pyramid(4, 32, 50, 4) == [50, 38, 26, 14]  # bottom capped, top raised: the same total
    model = tiny_llama(layers=6)
    prompt = lookup_prompt(60)
    cache = _prefilled(model, "pyramidkv:window=4,beta=4", "12", prompt)
    shares = pyramid(6, 8, 55, 4)  # a = 12 - 4, cap = 59 - 4
    assert shares == sorted(shares, reverse=True) and sum(shares) == 6 * 8
    assert cache.counts.tolist() == [[4 + b] * 2 for b in shares]
    assert cache.kept() == 6 * 2 * 12  # a uniform budget's total


@torch.inference_mode()
def test_cake_preference_indicator_and_cascade():
    # preference: entropy of the window's attention times its variance across queries
    spread = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])[None, None]  # [H_kv=1, g=1, w=2, 4]
    a = spread[0, 0]
    entropy = float(-(a * a.log()).sum())
    variance = float(a.var(0).sum())
    assert preference(spread, 1, 1) == pytest.approx(entropy * variance, rel=1e-5)
    assert preference(spread, 2, 0.5) == pytest.approx(entropy ** 0.5 * variance ** 2, rel=1e-5)
    ind = indicator(spread, gamma=10, kernel=1)
    torch.testing.assert_close(ind[0], a.mean(0) + 10 * a.var(0))

    # the cascade, three full-attention layers: each new layer re-splits the total
    s = _layout(layers=3)
    policy = make_policy("cake:window=2,kernel=1", "8")  # m = 8, w = 2: 6 per layer, 18 in all
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=30)
    n = 20
    policy.begin_prefill(cache, n)
    torch.manual_seed(2)
    prefs, kept = [], []
    for layer, temperature in enumerate((1.0, 1.0, 0.3)):
        rows = (torch.randn(2, 2 * 2, n) / temperature).softmax(-1)  # [H_kv, g*w, n]
        policy.store_prefill(cache, layer, False, torch.randn(2, 2, n, 8), rows)
        prefs.append(preference(rows.unflatten(1, (2, 2))[..., :18], 1, 1))
        want = apportion(prefs, 18, 18)
        kept.append([p - 2 for p in cache.prefix[:layer + 1]])
        assert all(got <= w for got, w in zip(kept[-1], want)) and sum(kept[-1]) >= 18 - layer
        assert sum(kept[-1]) <= 18  # never more than the total, even mid-prefill
    assert kept[0] == [18]  # alone, the first layer may keep everything before its window
    policy.end_prefill(cache, n)
    final = apportion(prefs, 18, 18)
    assert all(abs(b - 18 * p / sum(prefs)) <= 1 for b, p in zip(final, prefs))
    assert abs(sum(cache.prefix) - 3 * 8) <= 2 and cache.counts[:, 0].tolist() == cache.prefix


@torch.inference_mode()
def test_cake_keeps_the_best_indicators():
    s = _layout(layers=1)
    policy = make_policy("cake:window=2,kernel=1,gamma=0", "5")  # 3 before the window
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=12)
    n = 10
    rows = torch.full((2, 4, n), 0.01)
    rows[0, :, 6] = rows[0, :, 2] = rows[0, :, 5] = 0.3  # head 0's best: 2, 5, 6
    rows[1, :, 0] = rows[1, :, 1] = rows[1, :, 7] = 0.3
    policy.begin_prefill(cache, n)
    kv = torch.randn(2, 2, n, 8)
    policy.store_prefill(cache, 0, False, kv, rows)
    policy.end_prefill(cache, n)
    assert cache.pos[0][:, :5].tolist() == [[2, 5, 6, 8, 9], [0, 1, 7, 8, 9]]


@torch.inference_mode()
def test_adakv_splits_a_layer_over_its_heads():
    votes = torch.tensor([[9.0] * 6, [5, 5, 1, 1, 1, 1]])
    assert head_counts(votes, 4, 0.5) == [5, 3]  # the module docstring's example
    assert head_counts(votes, 4, 0.0) == [6, 2]
    assert head_counts(votes, 4, 1.0) == [4, 4]
    assert sum(head_counts(torch.rand(3, 40), 7, 0.2)) == 21

    s = _layout(layers=1)
    policy = make_policy("adakv:window=2,kernel=1,alpha=0", "6")  # 4 per head before the window
    cache = RaggedKVCache(s, torch.float32, "cpu", capacity_hint=14)
    n = 12
    scores = torch.zeros(2, n)
    scores[0, [1, 3, 4, 6, 7, 8]] = 5.0  # head 0's attention is spread over six tokens
    scores[1, [2, 9]] = 9.0  # head 1's on two
    policy.begin_prefill(cache, n)
    kv = torch.randn(2, 2, n, 8)
    policy.store_prefill(cache, 0, False, kv, scores)
    policy.end_prefill(cache, n)
    assert cache.counts.tolist() == [[6 + 2, 2 + 2]]  # joint top-8: six of head 0's, two of head 1's
    assert cache.pos[0].tolist()[0][:8] == [1, 3, 4, 6, 7, 8, 10, 11]
    assert cache.pos[0].tolist()[1][:8] == [2, 9, 10, 11, -1, -1, -1, -1]  # padded to the longer head
    assert cache.nbytes() == 8 * 2 * 2 * 8 * 4  # padding counted


def _prefilled(model, spec, budget, prompt):
    runner = under_policy(runner_for(model, "native"), make_policy(spec, budget))
    cache = runner.new_cache(len(prompt) + 40)
    runner.prefill(cache, prompt[:-1])
    return cache


@pytest.mark.parametrize("spec", SPECS)
def test_totals_and_bytes_follow_the_budget(spec):
    model = tiny_llama(layers=6)
    prompt = lookup_prompt(60)
    cache = _prefilled(model, spec, "12", prompt)
    full = _prefilled(model, "snapkv", "100000", prompt)
    n, layers, heads = 59, 6, 2
    assert cache.kept() == layers * heads * 12  # the uniform budget's total (shares are whole entries)
    slot = full.nbytes() // (layers * n)
    assert cache.nbytes() == sum(cache.prefix) * slot
    if spec.startswith("adakv"):  # heads padded to the longest of their layer: more than kept, less than full
        assert cache.kept() // heads * slot <= cache.nbytes() < full.nbytes()
    else:
        assert cache.nbytes() == layers * 12 * slot  # 12 of 59 per layer, as the budget says
    assert cache.nbytes() <= full.nbytes() * 0.4


def test_uniform_settings_keep_what_snapkv_keeps():
    """``pyramidkv:beta=1`` (flat pyramid) and ``adakv:alpha=1`` (even split) are SnapKV."""
    model = tiny_llama(layers=6)
    prompt = lookup_prompt(60)
    snap = _prefilled(model, "snapkv:window=4", "12", prompt)
    for spec in ("pyramidkv:window=4,beta=1", "adakv:window=4,alpha=1"):
        cache = _prefilled(model, spec, "12", prompt)
        assert all(torch.equal(cache.pos[i][:, :12], snap.pos[i, :, :12]) for i in range(6)), spec
        assert all(torch.equal(cache.kv[i][:, :, :12], snap.kv[i, :, :, :12]) for i in range(6)), spec


def test_gemma_sliding_layers_keep_their_recent_entries():
    model = tiny_gemma3()
    prompt = lookup_prompt(60)
    for spec in SPECS:
        cache = _prefilled(model, spec, "12", prompt)
        for layer in range(4):
            if cache.layout.is_sliding(layer):
                assert cache.pos[layer][:, :12].tolist() == [list(range(47, 59))]
        assert cache.kept() == 4 * 12


@pytest.mark.parametrize("budget", ["100000", "12"])
@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
def test_every_drafter_equals_ar(model_name, budget):
    """Selection at prefill only: under any budget every drafter's output equals ``ar``'s under the
    same policy; a covering budget equals ``ar`` without a policy."""
    model = tiny_llama(layers=6) if model_name == "llama" else tiny_gemma3()
    prompt = lookup_prompt(60)
    plain = ar_tokens(model, prompt) if budget == "100000" else None
    for spec in SPECS:
        assert_drafters_equal_ar(model, spec, budget, prompt, plain=plain)


def test_query_agnostic_protocol_and_bad_options():
    model = tiny_llama(layers=6)
    prompt = lookup_prompt(60)
    plain = ar_tokens(model, prompt, 16)
    for spec in SPECS:
        runner = under_policy(runner_for(model, "native"), make_policy(spec, "100000"))
        engine = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
        assert engine.generate(prompt, 16, query_start=30).tokens == plain
    for bad in ("adakv:alpha=2", "pyramidkv:beta=0.5", "cake:tau1=0", "cake:kernel=4", "adakv:window=0",
                "pyramidkv:oops=1", "cake:gamma=x"):
        with pytest.raises(SpeculumError):
            make_policy(bad, "12")
    assert math.isclose(make_policy("cake:tau1=1.6,tau2=0.4", "12").tau2, 0.4)
