"""DraftTree structure, KVCache commit/rollback, and runner logits against full recomputation."""

import random

import pytest
import torch

from speculum.drafting.tree_growth import DynamicTree
from speculum.runners import HFRunner
from speculum.tree import DraftTree


def test_chain_tree_structure():
    t = DraftTree.chain([5, 6, 7])
    assert t.is_chain and t.depths() == [1, 2, 3] and t.path_to(2) == [0, 1, 2]
    m = t.ancestor_mask()
    assert torch.equal(m, torch.ones(4, 4, dtype=torch.bool).tril())


def test_branching_tree_mask():
    t = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2])
    assert not t.is_chain and t.depths() == [1, 2, 1, 2]
    assert t.children() == [[0, 2], [1], [], [3], []]
    m = t.ancestor_mask()
    # node 3 (row 4) sees root, node 2, itself; not nodes 0, 1
    assert m[4].tolist() == [True, False, False, True, True]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1])


def test_cut_after_drops_what_follows_an_end_token():
    # 0 -> 1 (end) -> 2 -> 3, 1 -> 4; 0 -> 5; root -> 6 (end) -> 7
    t = DraftTree([10, 99, 12, 13, 14, 15, 99, 17], [-1, 0, 1, 2, 1, 0, -1, 6], scores=[.9, .8, .7, .6, .5, .4, .3, .2],
                  tags=list("abcdefgh"))
    cut = t.cut_after({99})
    assert cut.tokens == [10, 99, 15, 99] and cut.parents == [-1, 0, 0, -1]
    assert cut.scores == [.9, .8, .4, .3] and cut.tags == list("abfg")
    assert t.cut_after({98}) is t and t.cut_after(set()) is t
    assert DraftTree.chain([99, 1]).cut_after({99}).tokens == [99]


def test_dynamic_trees_do_not_grow_below_an_end_token():
    grow = DynamicTree(top_k=2, ends=frozenset({7}))
    level = grow.add_children([-1], torch.log(torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9]])))
    assert [grow.tokens[i] for i in level] == [7, 1]
    assert [grow.tokens[i] for i in grow.frontier(level)] == [1]  # the likelier node ends the request


def _full_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def test_cache_commit_gather_and_rollback(tiny_model):
    runner = HFRunner(tiny_model)
    cache = runner.new_cache(4)  # small on purpose: must grow
    runner.prefill(cache, list(range(1, 20)))
    assert cache.length == 19
    tree = DraftTree([30, 31, 32, 33], [-1, 0, -1, 2])
    runner.forward_tree(cache, 20, tree)
    cache.commit([0, 3, 4])  # root, node 2, node 3
    assert cache.length == 22
    # the cache now holds the sequence 1..20, 32, 33: logits of the next token must match recomputation
    seq = list(range(1, 21)) + [32, 33]
    nxt = runner.forward_tree(cache, 40, DraftTree())
    torch.testing.assert_close(nxt[-1].float(), _full_logits(tiny_model, seq + [40])[-1], atol=1e-4, rtol=1e-4)
    cache.rollback(10)
    nxt = runner.forward_tree(cache, 41, DraftTree())
    torch.testing.assert_close(nxt[-1].float(), _full_logits(tiny_model, list(range(1, 11)) + [41])[-1],
                               atol=1e-4, rtol=1e-4)
    assert cache.nbytes() > 0


@pytest.mark.parametrize("seed", range(6))
def test_tree_logits_equal_per_path_recomputation(tiny_model, seed):
    """Every node's logits from one tree forward equal a plain forward over its root-to-node path,
    also past the sliding window (the prefix is longer than Gemma-3's window of 8)."""
    rng = random.Random(seed)
    runner = HFRunner(tiny_model)
    prefix = [rng.randrange(1, 96) for _ in range(rng.randint(1, 40))]
    cache = runner.new_cache(64)
    runner.prefill(cache, prefix[:-1])
    n = rng.randint(1, 20)
    parents = [rng.randrange(-1, i) for i in range(n)]
    tree = DraftTree([rng.randrange(96) for _ in range(n)], parents)
    logits = runner.forward_tree(cache, prefix[-1], tree).float()
    torch.testing.assert_close(logits[0], _full_logits(tiny_model, prefix)[-1], atol=1e-4, rtol=1e-4)
    for i in range(n):
        path = [tree.tokens[j] for j in tree.path_to(i)]
        ref = _full_logits(tiny_model, prefix + path)[-1]
        torch.testing.assert_close(logits[i + 1], ref, atol=1e-4, rtol=1e-4)
