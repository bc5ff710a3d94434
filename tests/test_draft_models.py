"""Draft-model methods: BiLD (``bild``), SpecDec++'s trained acceptance head (``specdecpp``) and
sampled draft-model trees (``draft_model`` with ``top_k > 1`` under sampling).

Greedy output equals plain decoding on the tiny Llama- and Gemma-3-shaped models (a second tiny
model with the same vocabulary drafts); sampled trees keep the target's distribution (chi-square,
and a tree whose siblings' draft probabilities are left un-renormalised fails it); each paper's
rule is checked on a constructed case.
"""

import math
import random
import warnings

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama
from test_sampling import VOCAB, chi2_pvalue, exact_joint, sample_pairs

from speculum.drafters import DRAFTERS
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.bild import BiLDDrafter, RollbackVerifier
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.drafters.specdecpp import SpecDecPPDrafter, rejection_risk, stop_after
from speculum.drafting import sampled_tree
from speculum.drafting.sampled_tree import draw_distinct
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.heads import acceptance as acceptance_heads
from speculum.heads.acceptance import (
    AcceptanceConfig,
    AcceptanceHead,
    draft_fingerprint,
    load_acceptance_head,
    save_acceptance_head,
)
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.train.acceptance import (
    AcceptancePairs,
    acceptance_labels,
    auc,
    collect_pairs,
    held_out_split,
    replay_stops,
    train_head,
    weighted_bce,
)
from speculum.tree import DraftTree
from speculum.verify import Verifier

NEW = 32


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 16))] for _ in range(n)]


def constant_head(hidden: int, accept: float) -> AcceptanceHead:
    """A head that predicts ``accept`` for every state."""
    head = AcceptanceHead(AcceptanceConfig(hidden, inner=0))
    with torch.no_grad():
        head.net.weight.zero_()
        head.net.bias.fill_(math.log(accept / (1 - accept)))
    return head


def _seeded(factory, *args):
    torch.manual_seed(0)
    return factory(*args)


def _quiet(factory, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return factory(*args, **kwargs)


@pytest.mark.parametrize("method", ["bild", "bild_never_falls_back", "specdecpp", "specdecpp_no_head",
                                    "specdecpp_prob_head", "draft_model_tree"])
def test_greedy_equals_ar(tiny_model, method):
    runner = NativeRunner(tiny_model)
    draft = tiny_llama(seed=7, vocab=tiny_model.config.vocab_size, layers=1, logit_scale=15.0)
    drafter = {
        "bild": lambda: BiLDDrafter(draft, fallback=0.3),
        "bild_never_falls_back": lambda: BiLDDrafter(draft, fallback=0.0, max_draft=6),
        "specdecpp": lambda: SpecDecPPDrafter(draft, head=constant_head(64, 0.85), stop=0.5),
        "specdecpp_no_head": lambda: _quiet(SpecDecPPDrafter, draft, stop=0.5),
        "specdecpp_prob_head": lambda: SpecDecPPDrafter(draft, head=_seeded(AcceptanceHead,
                                                                            AcceptanceConfig(64, 8, draft_prob=True))),
        "draft_model_tree": lambda: DraftModelDrafter(draft, top_k=3, num_draft=4),
    }[method]()
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    engine = Engine(runner, drafter, eos_token_ids=[])
    drafted = 0
    for prompt in _prompts(12, 4):
        out = engine.generate(prompt, NEW)
        assert out.tokens == ar.generate(prompt, NEW).tokens
        drafted += sum(s.drafted for s in out.steps)
    assert drafted > 0


# --- BiLD -----------------------------------------------------------------------------------------

def _draft_max_probs(draft, seq):
    with torch.no_grad():
        return torch.softmax(draft(torch.tensor([seq])).logits[0].float(), -1).max(-1).values  # [T]


@pytest.mark.parametrize("fallback", [0.0, 0.2, 0.3, 1.0])
def test_bild_drafts_exactly_while_the_small_model_is_confident(fallback):
    """The chain holds the small model's greedy tokens while its top probability is >= fallback and
    ends at the first position where it is below (or at max_draft)."""
    draft = tiny_llama(seed=7, layers=1, logit_scale=15.0)
    drafter = BiLDDrafter(draft, fallback=fallback, max_draft=6)
    drafter.reset([1, 2, 3], SamplingParams(), None)
    lengths = set()
    for prompt in _prompts(10, 8):
        tree = drafter.propose(prompt, 64)
        conf = _draft_max_probs(draft, prompt + tree.tokens)[len(prompt) - 1:]  # [len(tree) + 1]
        assert all(float(c) >= fallback for c in conf[:len(tree)])
        if len(tree) < 6:
            assert float(conf[len(tree)]) < fallback
        with torch.no_grad():  # and they are the small model's greedy tokens
            greedy = draft(torch.tensor([prompt + tree.tokens])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert tree.tokens == greedy
        lengths.add(len(tree))
    if fallback == 0.0:
        assert lengths == {6}
    elif fallback == 1.0:
        assert lengths == {0}
    else:
        assert len(lengths) > 1  # the rule, not a fixed length


def test_bild_rollback_rule_on_a_constructed_chain():
    """Chain [a, b, c]: the target's argmax is a at row 0, d at rows 1 and 2, with p(b) = .2 and
    p(c) = .05. Exact (rollback=0): a + bonus d. rollback=2: -log .2 = 1.6 <= 2 keeps b; c's
    -log .05 = 3.0 > 2 and is not the argmax: a, b + bonus d."""
    a, b, c, d = 1, 2, 3, 4
    probs = torch.full((4, 8), 1e-3)
    probs[0, a] = 0.9
    probs[1, b], probs[1, d] = 0.2, 0.7
    probs[2, c], probs[2, d] = 0.05, 0.9
    probs[3, d] = 0.9
    logits = probs.log()
    tree = DraftTree.chain([a, b, c])
    greedy = SamplingParams()
    assert Verifier(greedy).accept(tree, logits).tokens == [a, d]
    assert RollbackVerifier(greedy, rollback=0.0).accept(tree, logits).tokens == [a, d]
    got = RollbackVerifier(greedy, rollback=2.0).accept(tree, logits)
    assert got.tokens == [a, b, d] and got.path == [0, 1]
    assert RollbackVerifier(greedy, rollback=3.5).accept(tree, logits).tokens == [a, b, c, d]


def test_bild_rollback_is_opt_in_lossy_and_warns():
    model = tiny_llama()
    draft = tiny_llama(seed=7, layers=1, logit_scale=15.0)
    assert BiLDDrafter(draft).verifier_cls is None  # lossless by default
    with pytest.warns(UserWarning, match="LOSSY"):
        lossy = BiLDDrafter(draft, fallback=0.0, rollback=50.0, max_draft=4)
    runner = NativeRunner(model)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    out = Engine(runner, lossy, eos_token_ids=[]).generate([1, 2, 3], 24)
    # every drafted token kept: the small model's text, not the target's
    assert out.tokens != ar.generate([1, 2, 3], 24).tokens
    assert all(s.accepted == s.drafted for s in out.steps)


@pytest.mark.parametrize("options", [{"fallback": 1.5}, {"fallback": -0.1}, {"rollback": -1}])
def test_bild_rejects_bad_options(options):
    with pytest.raises(SpeculumError):
        BiLDDrafter(tiny_llama(layers=1), **options)


# --- SpecDec++ ------------------------------------------------------------------------------------

def test_specdecpp_stop_rule_on_constructed_predictions():
    assert stop_after([0.9, 0.8, 0.7, 0.9], 0.5) == 4  # risks .1, .28, .496, .55
    assert stop_after([0.9, 0.8, 0.7], 0.5) == 3  # never above h: all of them
    assert stop_after([0.4, 0.9], 0.5) == 1
    assert rejection_risk([0.5, 0.5]) == pytest.approx(0.75)


@pytest.mark.parametrize("accept,stop,length", [(0.9, 0.5, 7), (0.3, 0.5, 1), (0.97, 0.2, 8)])
def test_specdecpp_drafts_the_length_its_head_predicts(accept, stop, length):
    """A constant head a: the chain ends at the first i with 1 - a^i > h (max_draft 8)."""
    model = tiny_llama()
    draft = tiny_llama(seed=7, layers=1)
    drafter = SpecDecPPDrafter(draft, head=constant_head(64, accept), stop=stop, max_draft=8)
    out = Engine(NativeRunner(model), drafter, eos_token_ids=[]).generate([1, 2, 3], 40)
    assert {s.drafted for s in out.steps[:-9]} == {length}  # (the last steps run out of room)
    assert drafter.predicted == pytest.approx([accept] * len(drafter.predicted), rel=1e-5)


def test_specdecpp_head_reads_the_state_the_token_was_drafted_from():
    """A head that predicts acceptance from the state: its a_i are its outputs on the draft's final
    hidden states at the positions the tokens were drafted from."""
    draft = tiny_llama(seed=7, layers=1)
    torch.manual_seed(1)
    head = AcceptanceHead(AcceptanceConfig(64, inner=8))
    drafter = SpecDecPPDrafter(draft, head=head, stop=0.99, max_draft=5)
    drafter.reset([1, 2, 3], SamplingParams(), None)
    tree = drafter.propose([1, 2, 3], 64)
    with torch.no_grad():
        hidden = draft(torch.tensor([[1, 2, 3] + tree.tokens]), output_hidden_states=True).hidden_states[-1][0]
        want = head.accept_prob(hidden[2:2 + len(tree)]).tolist()
    assert drafter.predicted == pytest.approx(want, abs=1e-4)


def test_specdecpp_head_files_and_bad_input(tmp_path):
    draft = tiny_llama(seed=7, layers=1)
    path = save_acceptance_head(tmp_path / "acc.safetensors", constant_head(64, 0.8), {"note": "test"})
    head, meta = load_acceptance_head(path, 64)
    assert meta == {"note": "test"} and float(head.accept_prob(torch.zeros(64))) == pytest.approx(0.8)
    assert path.stat().st_size < 10_000
    drafter = DRAFTERS["specdecpp"].factory(draft_model=draft, draft_head=(str(path),))
    assert drafter.head is not None
    with pytest.raises(SpeculumError, match="hidden size"):
        load_acceptance_head(path, 32)
    with pytest.raises(SpeculumError, match="does not exist"):
        SpecDecPPDrafter(draft, head=tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a head")
    with pytest.raises(SpeculumError, match="not an acceptance head"):
        SpecDecPPDrafter(draft, head=tmp_path / "junk.safetensors")
    with pytest.raises(SpeculumError, match="threshold"):
        SpecDecPPDrafter(draft, head=path, stop=1.0)


def test_acceptance_trainer_labels_and_fit():
    """Greedy labels are the argmax matches; the trained head's mean prediction follows them and
    its weighted loss falls below the constant head's at the data's mean."""
    target, draft = tiny_llama(), tiny_llama()
    with torch.no_grad():  # the target with a noisy LM head: the draft agrees with it some of the time
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)))
    seqs = [(p + [random.Random(i).randrange(TINY_VOCAB) for _ in range(24)], len(p))
            for i, p in enumerate(_prompts(16, 5))]
    pairs = collect_pairs(target, draft, seqs, progress=False)
    ids, start = seqs[0]
    with torch.no_grad():
        tl, dl = target(torch.tensor([ids])).logits[0], draft(torch.tensor([ids])).logits[0]
    want = (tl.argmax(-1) == dl.argmax(-1)).float()[start - 1:len(ids) - 1]
    assert torch.equal(pairs.label[:len(want)], want)
    assert 0.0 < float(pairs.label.mean()) < 1.0
    soft = acceptance_labels(tl, dl, 1.0)
    assert bool(((soft > 0) & (soft <= 1)).all())
    head, stats = train_head(pairs, inner=16, reject_weight=1.0, steps=150, progress=False)
    assert abs(stats["head_pred_mean"] - stats["held_label_mean"]) < 0.25
    assert {"head_auc", "standin_auc", "head_tokens_per_step", "standin_tokens_per_step"} <= stats.keys()
    mean = float(pairs.label.mean())
    const = weighted_bce(torch.full_like(pairs.label, math.log(mean / (1 - mean))), pairs.label, 1.0)
    assert float(weighted_bce(head(pairs.hidden), pairs.label, 1.0)) < float(const)
    head, _ = train_head(pairs, inner=16, reject_weight=1.0, steps=150, progress=False, draft_prob=True)
    assert float(weighted_bce(head(pairs.hidden, pairs.draft_prob), pairs.label, 1.0)) < float(const)
    with pytest.raises(SpeculumError, match="probability"):
        head(pairs.hidden)


def test_held_out_metrics_on_constructed_cases():
    """AUC ranks accepted pairs above rejected ones (ties half); the stop rule's replay along the
    target's path counts each chain's leading accepted run and its drafted tokens; held-out pairs
    are whole sequences."""
    label = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert auc(torch.tensor([0.9, 0.8, 0.3, 0.1]), label) == 1.0
    assert auc(torch.tensor([0.1, 0.3, 0.8, 0.9]), label) == 0.0
    assert auc(torch.full((4,), 0.5), label) == 0.5
    seq, y = torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 0.0, 1.0, 1.0])
    # a = .3: every chain stops after one token, which is accepted where the label is 1
    assert replay_stops(torch.full((4,), 0.3), y, seq, 0.5) == {"tokens_per_step": 1.75, "drafted_per_step": 1.0}
    # a = .99: chains run to the sequence's end: drafted 4, 3, 2, 1; accepted runs 1, 0, 2, 1
    assert replay_stops(torch.full((4,), 0.99), y, seq, 0.5) == {"tokens_per_step": 2.0, "drafted_per_step": 2.5}
    pairs = AcceptancePairs(torch.zeros(40, 4), torch.ones(40), seq=torch.arange(40) // 4)
    train, held = held_out_split(pairs, 0.2)
    assert len(held) == 8 and not set(pairs.seq[train].tolist()) & set(pairs.seq[held].tolist())


def test_shipped_acceptance_head_is_used_for_its_pair_only(tmp_path, monkeypatch):
    """A head filed for (target, draft) is found for that draft, keeps greedy output equal to plain
    decoding, and is not used for another draft or target (the stand-in warns instead)."""
    target, draft = tiny_llama(), tiny_llama(seed=7, layers=1, logit_scale=15.0)
    monkeypatch.setattr(acceptance_heads, "SHIPPED", tmp_path)
    monkeypatch.setattr(acceptance_heads, "target_key", lambda m: "tiny" if m is target else "other")
    path = save_acceptance_head(tmp_path / "tiny" / "acceptance-d7.safetensors", constant_head(64, 0.85),
                                {"target": "tiny", "draft_fingerprint": draft_fingerprint(draft)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = DRAFTERS["specdecpp"].factory(draft_model=draft, target=target, draft_head=None, stop=0.5)
        standin = SpecDecPPDrafter(draft, target=target, head="calibrated")
    assert drafter.head_file == path and standin.head is None and standin.stop_risk == 0.7
    runner = NativeRunner(target)
    ar, engine = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[]), Engine(runner, drafter, eos_token_ids=[])
    for prompt in _prompts(6, 4):
        assert engine.generate(prompt, NEW).tokens == ar.generate(prompt, NEW).tokens
    assert drafter.predicted == pytest.approx([0.85] * len(drafter.predicted), rel=1e-5) and drafter.predicted
    for other_draft, other_target in ((tiny_llama(seed=8, layers=1), target), (tiny_llama(seed=7, layers=2), target),
                                      (draft, tiny_llama(seed=3))):
        with pytest.warns(UserWarning, match="without an acceptance head"):
            assert SpecDecPPDrafter(other_draft, target=other_target).head is None
    with pytest.warns(UserWarning, match="trained for another draft"):
        SpecDecPPDrafter(tiny_llama(seed=8, layers=1), head=path)


def test_the_shipped_smollm2_acceptance_head_records_its_pair():
    """The head shipped for the packaged SmolLM2 names its target and its draft (the first 24 of 30
    layers) and records held-out numbers for it and the calibrated stand-in."""
    path = acceptance_heads.SHIPPED / "SmolLM2-135M-Instruct.Q4_1" / "acceptance-first24.safetensors"
    _, meta = load_acceptance_head(path, 576)
    assert meta["target"] == "SmolLM2-135M-Instruct.Q4_1" and meta["draft"] == "first:24"
    assert meta["draft_fingerprint"]["layers"] == 24 and meta["draft_fingerprint"]["hidden"] == 576
    assert meta["head_auc"] > meta["standin_auc"]
    assert path.stat().st_size < 400_000


@pytest.mark.slow
def test_shipped_acceptance_head_on_the_packaged_smollm2(smollm2_gguf):
    """On the default model as users run it, the shipped head is picked for the first-24-layers
    draft (not for a 23-layer one) and greedy output still equals plain decoding."""
    from speculum.prompts import encode_prompt
    from speculum.train.acceptance import first_layers

    model, tok = smollm2_gguf
    draft = first_layers("default", 24, tok)
    drafter = SpecDecPPDrafter(draft, target=model)
    assert drafter.head_file is not None and drafter.head_file.name == "acceptance-first24.safetensors"
    with pytest.warns(UserWarning, match="without an acceptance head"):
        assert SpecDecPPDrafter(first_layers("default", 23, tok), target=model).head is None
    ids = encode_prompt(tok, "Explain in two sentences why the sky is blue.")
    runner = NativeRunner(model)
    want = Engine(runner, AutoregressiveDrafter(), tok).generate(ids, 24).tokens
    assert Engine(runner, drafter, tok).generate(ids, 24).tokens == want


# --- sampled draft-model trees ----------------------------------------------------------------------

def test_draw_distinct_renormalises_without_the_earlier_siblings():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    tokens, rows = draw_distinct(q, 4, torch.Generator().manual_seed(0))
    assert sorted(tokens) == [0, 1, 2]  # q's support runs out: three, all distinct
    for j, (tok, row) in enumerate(zip(tokens, rows)):
        assert float(row.sum()) == pytest.approx(1.0)
        assert all(float(row[t]) == 0.0 for t in tokens[:j])
        rest = q.clone()
        rest[tokens[:j]] = 0
        assert torch.allclose(row, rest / rest.sum())


def test_sampled_tree_shape():
    """Under sampling, top_k > 1: a tree (distinct siblings, one q row per node, no scores);
    sampled_tree=False keeps the chain."""
    draft = tiny_llama(seed=7, layers=1)
    params = SamplingParams(temperature=1.0)
    drafter = DraftModelDrafter(draft, top_k=3, num_draft=3, max_nodes=24)
    drafter.reset([1, 2, 3], params, torch.Generator().manual_seed(0))
    tree = drafter.propose([1, 2, 3], 64)
    assert not tree.is_chain and tree.scores is None and tree.draft_probs.shape == (len(tree), TINY_VOCAB)
    assert len(tree) == 3 + 9 + 9 and max(tree.depths()) == 3  # all of depth 1 expanded, then 3 of depth 2
    for kids in tree.children():
        assert len({tree.tokens[c] for c in kids}) == len(kids)
    chain = DraftModelDrafter(draft, top_k=3, num_draft=3, sampled_tree=False)
    chain.reset([1, 2, 3], params, torch.Generator().manual_seed(0))
    assert chain.propose([1, 2, 3], 64).is_chain


class TopTokensAsSamples:
    """Wrong on purpose: siblings are the draft's most likely tokens (a greedy top-k tree) labelled
    with the rows they would have been drawn from: nodes not drawn from their q."""

    def __enter__(self):
        self.real = sampled_tree.draw_distinct

        def broken(q, count, generator):
            tokens, _ = self.real(q, count, generator)
            top = q.topk(len(tokens)).indices.tolist()
            fixed, rest = [], q.float().clone()
            for tok in top:
                fixed.append(rest / rest.sum())
                rest[tok] = 0.0
            return top, fixed

        sampled_tree.draw_distinct = broken

    def __exit__(self, *exc):
        sampled_tree.draw_distinct = self.real


@pytest.mark.parametrize("variant", ["sampled_tree", "bild", "broken_sampled_tree"])
def test_sampled_paths_keep_the_target_distribution(variant):
    model = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    draft = tiny_llama(seed=4, vocab=VOCAB, logit_scale=5.0)
    if variant == "bild":
        drafter = BiLDDrafter(draft, fallback=0.3, max_draft=2)
    else:
        drafter = DraftModelDrafter(draft, top_k=3, num_draft=2, max_nodes=8)
    engine = Engine(NativeRunner(model), drafter, eos_token_ids=[])
    n = 3000  # (test_sampling.py's tests of the verifier itself use 12000)
    if variant.startswith("broken"):
        with TopTokensAsSamples():
            p = chi2_pvalue(sample_pairs(engine, n, seed0=9000), exact_joint(model), n)
        assert p < 1e-6
        return
    p = chi2_pvalue(sample_pairs(engine, n, seed0=3000), exact_joint(model), n)
    assert p > 1e-3, f"{variant}: chi-square p = {p:.2e}"


def test_sampled_tree_accepts_more_than_a_sampled_chain():
    """Three drawn siblings per node, three depths, against the sampled chain of three (fixed seeds)."""
    model = tiny_llama(logit_scale=2.0)
    draft = tiny_llama(seed=7, layers=1, logit_scale=2.0)
    params = SamplingParams(temperature=1.0)
    runner = NativeRunner(model)
    rates = []
    for top_k in (1, 3):
        engine = Engine(runner, DraftModelDrafter(draft, top_k=top_k, num_draft=3, adaptive=False), eos_token_ids=[])
        outs = [engine.generate(p, 64, params, seed=i) for i, p in enumerate(_prompts(6, 6))]
        rates.append(sum(sum(s.accepted for s in o.steps) for o in outs) / sum(len(o.steps) for o in outs))
    assert rates[1] > rates[0]


@pytest.mark.slow
def test_packaged_smollm2_with_its_int4_copy_as_draft(smollm2_f32):
    """SmolLM2 (float32) with its int4 copy drafting: bild, specdecpp and the sampled tree's greedy
    twin (draft_model_tree) give plain decoding's tokens on a real prompt."""
    import speculum
    from speculum.prompts import encode_prompt

    model, tok = smollm2_f32
    draft, _ = speculum.load("default", dtype="float32", tokenizer=tok, weights="int4")
    ids = encode_prompt(tok, "Explain in two sentences why the sky is blue.")
    runner = NativeRunner(model)
    want = Engine(runner, AutoregressiveDrafter(), tok).generate(ids, 24).tokens
    hidden = model.config.hidden_size
    for drafter in (BiLDDrafter(draft), SpecDecPPDrafter(draft, head=constant_head(hidden, 0.9)),
                    DraftModelDrafter(draft, top_k=3, num_draft=4)):
        out = Engine(runner, drafter, tok).generate(ids, 24)
        assert out.tokens == want, drafter.name
        assert out.mean_accepted > 1.5, drafter.name
