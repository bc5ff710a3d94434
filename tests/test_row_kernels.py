"""The row-selection kernels (speculum/cache/row_kernels.cpp) against the torch code they replace."""

from types import SimpleNamespace

import pytest
import torch

from speculum.attention import Step
from speculum.cache.row_kernels import row_kernels
from speculum.kv import hip as hip_module
from speculum.kv import rows as rows_module
from speculum.kv.hip import HiPPolicy
from speculum.kv.rows import RowView, row_reads

ops = row_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="row kernels not built here")


def tree_step(L: int) -> Step:
    """A root and two children, one with a child of its own: positions L, L+1, L+1, L+2."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    return Step(torch.tensor([L, L + 1, L + 1, L + 2]), mask)


def test_row_topk_is_a_stable_top_k_over_candidates():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        B, n, C = (int(x) for x in torch.randint(1, 6, (3,), generator=g) * torch.tensor([1, 1, 8]))
        scores = torch.randint(0, 4, (B, n, C), generator=g).float()  # many ties
        scores[0, 0, 0] = float("nan")
        cand = torch.rand(n, C, generator=g) < 0.6
        k = int(torch.randint(0, C + 2, (1,), generator=g))
        ref = scores.nan_to_num(float("-inf")).masked_fill(~cand, float("-inf"))
        idx = ref.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        want = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, idx, True) & cand
        assert torch.equal(ops.row_topk(scores, cand[None].contiguous(), k), want)


def test_row_reads_matches_the_torch_code(monkeypatch):
    g = torch.Generator().manual_seed(1)
    L, heads = 40, 3
    rows = RowView.of(L, tree_step(L))
    for density in (0.1, 0.5, 1.0):
        visible = (torch.rand(heads, rows.n, rows.columns, generator=g) < density) & rows.context
        got = row_reads(visible, rows, heads)
        monkeypatch.setattr(rows_module, "row_kernels_for", lambda t: None)
        want = row_reads(visible, rows, heads)
        monkeypatch.undo()
        assert (got[0] is None) == (want[0] is None)
        if want[0] is not None:
            assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("block", [1, 2, 3])
def test_hip_search_matches_the_torch_search(monkeypatch, block):
    g = torch.Generator().manual_seed(block)
    L, heads, group, d = 97, 2, 3, 16
    step = tree_step(L)
    kv = torch.randn(1, 2, heads, L + 8, d, generator=g)
    cache = SimpleNamespace(kv=kv, layout=SimpleNamespace(kv_heads=heads, group=group), state=SimpleNamespace(read=24))
    q = torch.randn(step.n, heads * group, d, generator=g)
    policy = HiPPolicy("0.25", block=block, sinks=4, window=8)
    rows = RowView.of(L, step)
    got = policy.select(cache, 0, q, None, rows)
    monkeypatch.setattr(hip_module, "row_kernels_for", lambda t: None)
    want = policy.select(cache, 0, q, None, rows)
    assert torch.equal(got, want)
    assert int(got.sum()) > 0


@pytest.mark.parametrize("L", [96, 99])
@torch.inference_mode()
def test_quest_select_matches_the_torch_selection(monkeypatch, L):
    """A tree step (at 99 its root completes a page that its descendants read) chooses the same tokens in
    ``quest_select`` as in the torch code, with and without rows covered by the budget."""
    from speculum.attention import AttentionLayout
    from speculum.kv import make_policy
    from speculum.kv import quest as quest_module

    g = torch.Generator().manual_seed(L)
    layout = AttentionLayout(layers=1, heads=6, kv_heads=2, head_dim=16, scale=0.25)
    for budget in ("12", "40"):
        policy = make_policy("quest:page=4,dense=0", budget)
        cache = policy.new_cache(layout, torch.float32, "cpu", L + 16)
        policy.begin_prefill(cache, L)
        policy.store_prefill(cache, 0, False, torch.randn(2, 2, L, 16, generator=g), None)
        policy.end_prefill(cache, L)
        step = tree_step(L)
        q, k, v = torch.randn(4, 6, 16, generator=g), torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
        seen: list[torch.Tensor] = []
        monkeypatch.setattr(quest_module, "read_rows", lambda *a, seen=seen: seen.append(a[5]))
        cache.begin(step.positions)
        policy.attend(cache, 0, False, q, k, v, step)
        monkeypatch.setattr(quest_module, "row_kernels_for", lambda t: None)
        policy.attend(cache, 0, False, q, k, v, step)
        monkeypatch.undo()
        assert len(seen) == 2 and torch.equal(seen[0], seen[1])
        assert 0 < int(seen[0].sum()) < seen[0].numel()
