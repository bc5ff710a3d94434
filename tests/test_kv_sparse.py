"""Decode-time sparse-read policies that decide per query row (speculum.kv.rows): Double Sparsity,
TokenSelect, Squeezed Attention, Recycled Attention, HiP.

- Constructed examples: each reads what its paper's rule says (a planted key the query matches is
  read; label channels are the outlier ones; the Selection Cache reuses a similar query's choice;
  k-means clusters the planted groups and the matching one is read; Recycled attends fully every
  ``stride`` positions and recycles in between; HiP's hierarchy finds the block with the planted key).
- The per-row reads: ``attend_rows`` equals masked dense attention, and each row of a tree step
  chooses what a one-token step at its position chooses (positions compared, no model involved).
- With a covering budget every drafter's greedy output equals plain decoding; with a lossy budget
  every drafter's equals ``ar``'s under the same policy (tiny Llama and Gemma-3, float32).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama
from kv_lossless import ar_tokens, assert_drafters_equal_ar, lookup_prompt

from speculum.attention import AttentionLayout, Step, attention, grouped
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.kv import make_policy
from speculum.kv.double_sparsity import label_channels
from speculum.kv.rows import RowView, read_rows
from speculum.kv.squeezed import kmeans
from speculum.kv.tokenselect import TokenSelectPolicy
from speculum.runners import runner_for, under_policy

LAYOUT = AttentionLayout(layers=1, heads=4, kv_heads=2, head_dim=8, scale=8 ** -0.5)

# lossy specs: options that make the tiny contexts sparse (TokenSelect's paper window covers them)
LOSSY = ["double_sparsity", "tokenselect:sinks=2,window=4", "squeezed", "recycled:stride=4", "hip"]


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():  # as the runner calls the policies
        yield


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    return tiny_llama(layers=6) if request.param == "llama" else tiny_gemma3()


def prefilled(spec: str, budget, keys: torch.Tensor, values: torch.Tensor | None = None,
              queries: torch.Tensor | None = None, layout: AttentionLayout = LAYOUT):
    """A policy (``dense=0``: layer 0 is sparse) and a cache prefilled with ``keys [H_kv, L, d]``."""
    policy = make_policy(spec + ("," if ":" in spec else ":") + "dense=0", budget)
    L = keys.shape[1]
    values = torch.randn_like(keys) if values is None else values
    cache = policy.new_cache(layout, torch.float32, "cpu", L + 32)
    policy.begin_prefill(cache, L)
    if policy.prefill_scores == "queries" and queries is None:
        queries = torch.randn(min(L, policy.observation_window), layout.heads, layout.head_dim)
    policy.store_prefill(cache, 0, False, torch.stack([keys, values]), queries)
    policy.end_prefill(cache, L)
    return policy, cache


def choose(policy, cache, q: torch.Tensor, k: torch.Tensor, step: Step) -> tuple[RowView, torch.Tensor]:
    """The rows' choices ``[H_kv or 1, n, L+n]`` for queries ``q [n, H, d]`` and new keys ``k [n, H_kv, d]``."""
    cache.begin(step.positions)
    cache.write(0, k, torch.zeros_like(k))
    rows = RowView.of(cache.length, step)
    return rows, policy.select(cache, 0, q, k, rows)


def one_step(position: int) -> Step:
    return Step(torch.tensor([position]), None)


def read_positions(rows: RowView, visible: torch.Tensor, i: int) -> list[set[int]]:
    """Per head, the positions row ``i`` reads."""
    return [set(rows.col_pos[visible[h, i]].tolist()) for h in range(visible.shape[0])]


# -- constructed examples ------------------------------------------------------------------------

def planted(L: int = 48, at: int = 17, strength: float = 6.0, channel: int | None = None):
    """Small random keys with one key (slot ``at``, both KV heads) along ``u``, and a query along ``u``."""
    torch.manual_seed(0)
    keys = 0.1 * torch.randn(2, L, 8)
    u = torch.zeros(8)
    if channel is None:
        u = torch.nn.functional.normalize(torch.randn(8), dim=0)
    else:
        u[channel] = 1.0
    keys[:, at] += strength * u
    q = (strength * u).expand(1, 4, 8).clone()
    return keys, q


def test_double_sparsity_labels_and_planted_key():
    keys, q = planted(channel=2)
    queries = 0.1 * torch.randn(16, 4, 8)
    queries[..., 2] += 3.0
    keys[:, -16:, 2] += 1.0
    assert label_channels(queries, keys[:, -16:], 1).tolist() == [[2], [2]]
    policy, cache = prefilled("double_sparsity:channels=1", "4", keys, queries=queries)
    assert cache.state.labels[0].tolist() == [[2], [2]]
    assert torch.equal(cache.state.label_keys[0][:, :48, 0], keys[:, :, 2])  # the label cache
    assert cache.nbytes() == 48 * cache.entry_bytes() + 2 * 48 * 1 * 4  # counted with the entries
    rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(48))
    assert all(17 in s and len(s) == 5 for s in read_positions(rows, visible | rows_self(rows), 0))
    # committed entries join the label cache
    cache.pending = 1
    cache.commit()
    policy.after_commit(cache)
    assert cache.state.filled == 49


def rows_self(rows: RowView) -> torch.Tensor:
    out = torch.zeros(1, rows.n, rows.columns, dtype=torch.bool)
    out[0, torch.arange(rows.n), rows.length + torch.arange(rows.n)] = True
    return out


def test_tokenselect_votes_for_the_planted_key_and_sinks_and_window():
    keys, q = planted()
    policy, cache = prefilled("tokenselect:sinks=2,window=3", "4", keys)
    rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(48))
    assert visible.shape[0] == 1  # one choice for every head of the layer
    read = read_positions(rows, visible, 0)[0]
    assert {0, 1, 45, 46, 47, 17} <= read and len(read) == 2 + 3 + 4


def test_tokenselect_selection_cache():
    """A query similar to the last one that chose reuses its choice; a dissimilar one votes anew.
    Along a chain of rows the same holds row by row."""
    keys, q = planted()
    policy, cache = prefilled("tokenselect:sinks=0,window=0,threshold=0.9", "4", keys)
    votes = []
    vote = TokenSelectPolicy.vote
    policy.vote = lambda *a: votes.append(a[2].shape[0]) or vote(policy, *a)
    choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(48))
    cache.pending = 1
    policy.before_commit(cache, None)
    cache.commit()
    assert votes == [1] and 17 in cache.state.anchors[0].positions.tolist()
    other = torch.randn(1, 4, 8)
    step = Step(torch.tensor([49, 50, 51]), None)  # a chain: similar, dissimilar, similar to the second
    qs = torch.cat([q * 1.01, other, other * 0.98])
    rows, visible = choose(policy, cache, qs, torch.zeros(3, 2, 8), step)
    assert votes == [1, 1]  # only the second row voted
    assert policy_pending(cache).anchor_of == [-1, 1, 1]
    assert 17 in read_positions(rows, visible, 0)[0]


def policy_pending(cache):
    return cache.state.pending[0]


def test_squeezed_kmeans_and_matching_cluster():
    torch.manual_seed(1)
    dirs = torch.nn.functional.normalize(torch.randn(3, 8), dim=1) * 4
    labels = torch.arange(30) % 3
    keys = (dirs[labels] + 0.05 * torch.randn(30, 8)).expand(2, -1, -1).clone()
    _, assign = kmeans(keys, 3, 10)
    for h in range(2):  # the three planted groups, whatever the cluster numbering
        assert len({(int(a), int(b)) for a, b in zip(assign[h], labels)}) == 3
    for spec in ("squeezed:ratio=0.1", "squeezed:ratio=0.1,threshold=0.05",
                 "squeezed:ratio=0.2,levels=2,coarse=2,widen=1"):
        policy, cache = prefilled(spec, "10", keys)
        assert cache.nbytes() > 30 * cache.entry_bytes()  # the centroids are counted
        q = (2 * dirs[1]).expand(1, 4, 8)
        rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(30))
        want = set(torch.nonzero(labels == 1)[:, 0].tolist())
        assert read_positions(rows, visible, 0) == [want, want], spec


def test_squeezed_reads_everything_after_the_fixed_context():
    keys, q = planted(L=40)
    policy, cache = prefilled("squeezed:ratio=0.1", "4", keys)
    for pos in (40, 41, 42):  # three generated tokens committed
        cache.begin(torch.tensor([pos]))
        cache.write(0, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
        cache.pending = 1
        cache.commit()
    rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(43))
    assert all({40, 41, 42} <= s and 17 in s for s in read_positions(rows, visible, 0))


def test_recycled_full_every_stride_and_recycled_between():
    """Positions A, A+stride, ... attend fully and pick; the rows between read the pick and what came since."""
    keys, q = planted(L=40)
    policy, cache = prefilled("recycled:stride=3", "4", keys)
    st = cache.state
    assert st.start == 40
    for pos in range(40, 47):
        qq = q if pos == 40 else torch.randn(1, 4, 8)
        rows, visible = choose(policy, cache, qq, torch.randn(1, 2, 8), one_step(pos))
        read = read_positions(rows, visible, 0)
        full = (pos - 40) % 3 == 0
        if full:
            assert read == [set(range(pos))] * 2
        else:
            anchor = pos - (pos - 40) % 3
            picked = set(st.picked[0][0].tolist())
            assert st.picked_at[0] == anchor and len(picked) == 4
            assert read[0] == picked | set(range(anchor, pos))
        cache.pending = 1
        policy.before_commit(cache, None)
        cache.commit()
        if pos == 40:
            assert 17 in st.picked[0][0].tolist() and 17 in st.picked[0][1].tolist()
    assert st.picked_at[0] == 46


def test_recycled_under_a_tree_uses_the_full_row_it_descends_from():
    keys, q = planted(L=40)
    policy, cache = prefilled("recycled:stride=2", "4", keys)
    # root at 40 (full), a at 41 (recycles the root's pick), b at 42 (full), c at 43 (recycles b's)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    step = Step(torch.tensor([40, 41, 42, 43]), mask)
    qs = torch.cat([q, torch.randn(3, 4, 8)])
    rows, visible = choose(policy, cache, qs, torch.randn(4, 2, 8), step)
    pend = cache.state.pending[0]
    assert pend.full == [0, 2]
    root_pick = set(rows.col_pos[pend.picked[0, 0]].tolist())
    assert 17 in root_pick and read_positions(rows, visible, 1)[0] == root_pick | {40}
    b_pick = set(rows.col_pos[pend.picked[0, 1]].tolist())
    assert read_positions(rows, visible, 3)[0] == b_pick | {42}
    policy.before_commit(cache, [0, 1])  # b and c rejected: the root's pick is committed
    assert cache.state.picked_at[0] == 40 and set(cache.state.picked[0][0].tolist()) == root_pick


def test_hip_hierarchy_finds_the_planted_block():
    """Keys vary smoothly with position around a planted one (attention locality): the search, judging
    halves by their centre keys, ends on the block that holds it."""
    torch.manual_seed(2)
    L, at = 128, 77
    u = torch.nn.functional.normalize(torch.randn(8), dim=0)
    bump = torch.exp(-((torch.arange(L) - at) ** 2) / (2 * 8.0 ** 2))
    keys = (6 * bump[:, None] * u + 0.05 * torch.randn(L, 8)).expand(2, -1, -1).clone()
    q = (3 * u).expand(1, 4, 8)
    for block in (1, 2, 4):
        policy, cache = prefilled(f"hip:block={block}", "8", keys)
        rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(L))
        for read in read_positions(rows, visible, 0):
            assert at in read and len(read) <= 8
            assert {(p // block) * block for p in read} <= {p for p in read}  # whole blocks


def test_hip_sinks_and_window_always_read():
    keys, q = planted(L=64)
    policy, cache = prefilled("hip:block=2,sinks=2,window=4", "4", keys)
    rows, visible = choose(policy, cache, q, torch.zeros(1, 2, 8), one_step(64))
    for read in read_positions(rows, visible, 0):
        assert {0, 1, 60, 61, 62, 63} <= read and len(read) <= 10


# -- per-row reads ---------------------------------------------------------------------------------

TREE = torch.tensor([[1, 0, 0, 0, 0],  # root, two children, a grandchild under the first, its child
                     [1, 1, 0, 0, 0],
                     [1, 0, 1, 0, 0],
                     [1, 1, 0, 1, 0],
                     [1, 1, 0, 1, 1]], dtype=torch.bool)
TREE_POS = [0, 1, 1, 2, 3]


def test_attend_rows_equals_masked_dense_attention():
    torch.manual_seed(3)
    L, n = 20, 5
    _, cache = prefilled("hip", "4", torch.randn(2, L, 8))
    step = Step(torch.tensor([L + d for d in TREE_POS]), TREE)
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    cache.begin(step.positions)
    rows = RowView.of(L, step)
    visible = (torch.rand(2, n, L + n) < 0.3) & rows.context
    out = read_rows(cache, 0, q, k, v, visible, rows, step)
    full = visible.clone()
    full[:, torch.arange(n), L + torch.arange(n)] = True
    want = attention(q, cache.kv[0, 0, :, :L + n], cache.kv[0, 1, :, :L + n], grouped(full, 2, torch.float32),
                     LAYOUT.scale)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("spec", ["double_sparsity:channels=2", "tokenselect:sinks=1,window=2,threshold=2",
                                  "tokenselect:sinks=0,window=0,threshold=2", "squeezed:ratio=0.2",
                                  "hip:block=2", "hip:block=1,sinks=1,window=1"])
def test_each_tree_row_chooses_as_a_one_token_step(spec):
    """Row i of a tree step over L committed tokens reads the positions a one-token step at its
    position reads, after its ancestors were committed one by one (window 2 < depth 3: ancestors
    compete with the committed tokens)."""
    torch.manual_seed(4)
    L, n = 24, 5
    keys, values = torch.randn(2, L, 8), torch.randn(2, L, 8)
    queries = torch.randn(16, 4, 8)
    q, k = torch.randn(n, 4, 8), torch.randn(n, 2, 8)
    policy, cache = prefilled(spec, "5", keys, values, queries)
    rows, visible = choose(policy, cache, q, k, Step(torch.tensor([L + d for d in TREE_POS]), TREE))
    for i in range(n):
        ancestors = [j for j in range(i) if TREE[i, j]]
        single, c1 = prefilled(spec, "5", keys, values, queries)
        for j in ancestors:  # committed one by one, as plain decoding would
            c1.begin(torch.tensor([L + TREE_POS[j]]))
            c1.write(0, k[j:j + 1], torch.zeros(1, 2, 8))
            c1.pending = 1
            c1.commit()
            single.after_commit(c1)
        r1, v1 = choose(single, c1, q[i:i + 1], k[i:i + 1], one_step(L + TREE_POS[i]))
        assert read_positions(rows, visible, i) == read_positions(r1, v1, 0), (spec, i)


# -- lossless -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["double_sparsity", "tokenselect", "squeezed", "recycled", "hip"])
def test_covering_budget_equals_plain_decoding(tiny, spec):
    p = lookup_prompt(60)
    assert_drafters_equal_ar(tiny, spec, "100000", p, plain=ar_tokens(tiny, p))


@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_budget_every_drafter_equals_ar(tiny, spec):
    """Decisions per row: speculation under a lossy budget gives what plain decoding under it gives."""
    assert_drafters_equal_ar(tiny, spec, "12", lookup_prompt(60))


def test_lossy_budget_reads_less_and_changes_output():
    """Budget 12 of a 60-token context is really sparse: the output differs from full attention."""
    model = tiny_gemma3()
    p = lookup_prompt(60)
    plain = ar_tokens(model, p)
    for spec in LOSSY:
        engine = Engine(under_policy(runner_for(model, "native"), make_policy(spec, "12")), AutoregressiveDrafter(),
                        eos_token_ids=[])
        assert engine.generate(p, 32).tokens != plain, spec


def test_bad_options():
    for spec in ("hip:block=0", "recycled:stride=0", "squeezed:levels=3", "squeezed:ratio=2",
                 "double_sparsity:channels=0", "tokenselect:window=-1", "hip:oops=1", "tokenselect:threshold=x"):
        with pytest.raises(SpeculumError):
            make_policy(spec, "12")
