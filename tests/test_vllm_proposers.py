"""speculum's vLLM proposers (speculum.integrations.vllm) driven the way vLLM's model runner calls a
``custom_class`` proposer, without vLLM: a fake engine keeps a batch of rows that move between steps,
verifies the returned chains greedily against a deterministic target and hands the proposer the
committed tokens, the token table and (through the wrapped ``compute_logits``) the step's logits."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculum.drafters import NgramDrafter
from speculum.integrations.vllm import PROPOSERS, BatchTracker

V = 61


def target_next(seq: list[int]) -> int:
    """The fake target's greedy next token: the prompt's last four tokens again and again, each
    round shifted by one (text that repeats, as drafters expect, but not verbatim)."""
    return (seq[-4] + (1 if len(seq) % 8 == 0 else 0)) % V


def plain(prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        seq.append(target_next(seq))
    return seq[len(prompt):]


class FakeModel:
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def config(k: int, max_len: int):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len))


def one_hot(tokens: list[int]) -> torch.Tensor:
    """``[n, V]`` logits whose argmax is each token, the runner-up the token after it."""
    logits = torch.zeros(len(tokens), V)
    for i, t in enumerate(tokens):
        logits[i, t] = 2.0
        logits[i, (t + 1) % V] = 1.0
    return logits


def run_fake_vllm(proposer, prompts: list[list[int]], new: int, concurrency: int, max_len: int = 256,
                  shuffle: bool = True, seed: int = 0) -> tuple[list[list[int]], list[int], list[int]]:
    """Serve ``prompts`` through a vLLM-like loop; returns outputs, tokens committed per (row, step)
    that verified a draft, and every draft's length."""
    model = FakeModel()
    proposer.load_model(model)
    steps = [0.0]  # the fake's clock: one unit per engine step (auto's bandit rates arms by it)
    if hasattr(proposer.tracker.root, "clock"):
        proposer.tracker.root.clock = lambda: steps[0]
    rng = random.Random(seed)
    queue = list(range(len(prompts)))
    rows: list[dict] = []  # {"rid", "tokens", "draft"}
    outputs: list[list[int] | None] = [None] * len(prompts)
    per_step, lengths = [], []
    while queue or rows:
        while queue and len(rows) < concurrency:
            rid = queue.pop(0)
            rows.append({"rid": rid, "tokens": list(prompts[rid]), "draft": None})
        if shuffle:
            rng.shuffle(rows)  # vLLM condenses and reorders its batch as requests come and go
        sampled, blocks = [], []
        for row in rows:
            seq, draft = row["tokens"], row["draft"] or []
            if row["draft"] is None:  # prefill: one sampled token, one logits row
                blocks.append(one_hot([target_next(seq)]))
                row["draft"] = []
                got = [target_next(seq)]
            else:
                got, targets = [], []
                for d in draft + [None]:
                    t = target_next(seq + got)
                    targets.append(t)
                    got.append(t)
                    if d != t:
                        break
                targets += [0] * (len(draft) + 1 - len(targets))  # rows past the rejection: any logits
                blocks.append(one_hot(targets))
                per_step.append(len(got))
            room = len(prompts[row["rid"]]) + new - len(seq)
            got = got[:room]
            seq.extend(got)
            sampled.append(got)
        model.compute_logits(torch.cat(blocks))
        steps[0] += 1.0
        table = np.zeros((max(concurrency, 1), max_len), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row["tokens"])] = row["tokens"]
        drafts = proposer.propose(sampled, np.array([len(r["tokens"]) for r in rows]), table)
        assert len(drafts) == len(rows)
        for row, draft in zip(rows, drafts):
            assert len(row["tokens"]) + len(draft) < max_len
            row["draft"] = draft
            lengths.append(len(draft))
        done = [r for r in rows if len(r["tokens"]) >= len(prompts[r["rid"]]) + new]
        for r in done:
            outputs[r["rid"]] = r["tokens"][len(prompts[r["rid"]]):]
            rows.remove(r)
    proposer.propose([], np.zeros(0, dtype=np.int32), np.zeros((1, max_len), dtype=np.int32))
    return outputs, per_step, lengths


def prompts_for(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_proposers_draft_for_every_request_of_a_moving_batch(name):
    k = 6
    proposer = PROPOSERS[name](config(k, 256))
    proposer.tracker.budget, proposer.tracker.full_batch_score = None, 0.0  # every draft verified
    prompts = prompts_for(12)
    outputs, per_step, lengths = run_fake_vllm(proposer, prompts, new=40, concurrency=5)
    assert outputs == [plain(p, 40) for p in prompts]
    assert max(lengths) <= k
    tracker = proposer.tracker
    # every request was recognised as one request all along, however the rows moved
    assert tracker.started == len(prompts) and tracker.finished == len(prompts)
    assert not tracker.rows
    # the periodic target is easy to draft: each drafter commits well over one token per step
    assert np.mean(per_step) > 2.0, np.mean(per_step)


def test_recycling_learns_from_the_wrapped_logits():
    prompts = prompts_for(6, seed=3)
    learnt = PROPOSERS["recycling"](config(6, 256))
    learnt.tracker.full_batch_score = 0.0
    _, with_logits, _ = run_fake_vllm(learnt, prompts, new=40, concurrency=3)
    blind = PROPOSERS["recycling"](config(6, 256))
    blind.reads_logits = False  # the logits never reach it: Token Recycling has nothing to draft from
    _, without, _ = run_fake_vllm(blind, prompts, new=40, concurrency=3)
    assert np.mean(without) == 1.0
    assert np.mean(with_logits) > 2.0


def test_logits_that_do_not_add_up_are_not_learnt_from():
    tracker = BatchTracker(NgramDrafter(), k=4, max_model_len=64)
    table = np.zeros((2, 64), dtype=np.int32)
    table[0, :5] = [1, 2, 3, 1, 2]
    tracker.step([[2]], np.array([5]), table)
    (live,) = tracker.rows.values()
    wrong = torch.zeros(len(live.chain) + 3, V)
    assert tracker._split([wrong], [[3]], [live]) == [None]
    right = torch.zeros(len(live.chain) + 1, V)
    (block,) = tracker._split([wrong, right], [[3]], [live])
    assert block.shape == right.shape


def test_no_draft_past_the_model_length_and_none_for_rows_in_prefill():
    tracker = BatchTracker(NgramDrafter(), k=8, max_model_len=12)
    table = np.zeros((2, 12), dtype=np.int32)
    table[0, :10] = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    drafts = tracker.step([[1], []], np.array([10, 4]), table)
    assert len(drafts[0]) <= 1 and drafts[1] == []
    assert tracker.started == 1


def test_the_same_prompt_twice_is_two_requests():
    tracker = BatchTracker(NgramDrafter(), k=4, max_model_len=64)
    table = np.zeros((2, 64), dtype=np.int32)
    table[:, :6] = [5, 6, 7, 5, 6, 7]
    tracker.step([[7], [7]], np.array([6, 6]), table)
    assert tracker.started == 2 and len({id(v) for v in tracker.rows.values()}) == 2


def test_zero_speculative_tokens_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PROPOSERS["ngram"](config(0, 64))


def _live(tokens: list[int], chain: list[int], scores: list[float] | None):
    from speculum.integrations.vllm import Live
    from speculum.tree import DraftTree

    tree = DraftTree.chain(chain)
    tree.scores = scores
    return Live(NgramDrafter(), tokens, tree)


def test_the_draft_budget_keeps_the_likeliest_tokens_across_rows():
    tracker = BatchTracker(NgramDrafter(), k=8, max_model_len=64, budget=5)
    rows = {0: _live([1], [5, 6, 7, 8], [0.9, 0.8, 0.3, 0.2]), 1: _live([2], [9, 10, 11], [0.95, 0.7, 0.6])}
    tracker._fit_budget(rows)
    assert rows[0].chain.tokens == [5, 6] and rows[1].chain.tokens == [9, 10, 11]  # 0.95, 0.9, 0.8, 0.7, 0.6 kept
    unscored = {0: _live([1], [5, 6, 7], None), 1: _live([2], [9, 10, 11], None)}
    tracker._fit_budget(unscored)
    assert [v.chain.tokens for v in unscored.values()] == [[5, 6, 7], [9, 10]]  # by depth


def test_unlikely_tokens_are_cut_only_under_load():
    tracker = BatchTracker(NgramDrafter(), k=8, max_model_len=64)
    assert tracker.min_score(1) == 0.0 and tracker.min_score(tracker.full_batch) == tracker.full_batch_score
    assert tracker.min_score(64) == tracker.full_batch_score
    one = {0: _live([1], [5, 6, 7], [0.9, 0.5, 0.1])}
    tracker._cut_unlikely(one)
    assert one[0].chain.tokens == [5, 6, 7]
    many = {i: _live([i], [5, 6, 7], [0.9, 0.5, 0.1]) for i in range(tracker.full_batch)}
    many[3] = _live([3], [5, 6, 7], None)  # no scores: kept whole
    tracker._cut_unlikely(many)
    assert many[0].chain.tokens == [5] and many[3].chain.tokens == [5, 6, 7]


def test_two_identical_requests_that_swap_rows_stay_two():
    tracker = BatchTracker(NgramDrafter(), k=4, max_model_len=64)
    table = np.zeros((2, 64), dtype=np.int32)
    table[:, :6] = [5, 6, 7, 5, 6, 7]
    tracker.step([[7], [7]], np.array([6, 6]), table)
    first = dict(tracker.rows)
    table[:, 6] = 5
    tracker.step([[5], [5]], np.array([7, 7]), table)
    assert {id(v) for v in tracker.rows.values()} == {id(v) for v in first.values()}
    assert all(len(v.tokens) == 7 for v in tracker.rows.values())
