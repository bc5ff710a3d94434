"""Constrained decoding composes with speculation without changing the output.

- Greedy (float32): every drafter and tree shape, with a constraint, gives exactly the tokens of
  plain constrained greedy decoding done by hand (full recomputation, mask, argmax), on a tiny
  random model with SmolLM2's tokenizer and on the real SmolLM2.
- Sampling: chi-square tests of the first two tokens against the exact constrained distribution,
  with point-mass drafts (chain and tree) and a draft model's sampled drafts; a verifier that
  keeps the draft model's unconstrained q must fail.
- Bad constraints are refused with a clear error.
"""

import json
import random
from collections import Counter

import jsonschema
import pytest
import torch
from conftest import OracleDrafter, tiny_llama
from scipy.stats import chisquare

from speculum.constrain import ConstraintSpec, Grammar, mask_logits
from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.base import Drafter
from speculum.drafters.draft_model import DraftModelDrafter
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import HFRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    },
    "required": ["name", "age"],
}
SPECS = [
    ConstraintSpec.json_schema(PERSON),
    ConstraintSpec.json_object(),
    ConstraintSpec.regex(r"(yes|no), because [a-z ]{1,30}\."),
    ConstraintSpec.choice(["positive", "negative", "neutral"]),
    ConstraintSpec.lark('start: "(" expr ")"\nexpr: NUMBER (("+" | "*") NUMBER)*\nNUMBER: /[0-9]{1,3}/\n'),
]


def reference_constrained_greedy(model, grammar: Grammar, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Plain constrained greedy decoding by hand: full forward, mask, argmax, advance the matcher."""
    m = grammar.matcher()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1:]
            tok = int(mask_logits(logits, m.allowed(DraftTree())).argmax())
            out.append(tok)
            if tok in eos:
                break
            m.commit([tok])
            ids.append(tok)
    return out


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_f32):
    return smollm2_f32[1]


@pytest.fixture(scope="module")
def tiny_wide():
    """A random 2-layer Llama with SmolLM2's 49152-wide vocabulary (fast, and every token id is real)."""
    return tiny_llama(seed=1, vocab=49152)


EOS = 2  # SmolLM2's <|im_end|>


@pytest.mark.parametrize("spec_i", range(len(SPECS)))
def test_constrained_greedy_lossless_every_drafter(tiny_wide, smol_tokenizer, spec_i):
    spec = SPECS[spec_i]
    runner = HFRunner(tiny_wide)
    prompt = encode_prompt(smol_tokenizer, "Answer in the requested format, please.")
    grammar = Grammar(spec, smol_tokenizer, 49152, [EOS])
    ref = reference_constrained_greedy(tiny_wide, grammar, prompt, 40, {EOS})
    assert len(ref) >= 2
    drafters = [AutoregressiveDrafter(), OracleDrafter(prompt + ref, 49152, shape="chain", seed=spec_i),
                OracleDrafter(prompt + ref, 49152, shape="tree", seed=spec_i)]
    for drafter in drafters:
        engine = Engine(runner, drafter, smol_tokenizer, eos_token_ids=[EOS])
        out = engine.generate(prompt, 40, grammar=grammar)
        assert out.tokens == ref, f"{drafter.name} ({getattr(drafter, 'shape', '')}) differs under {spec.kind}"
    for name in ("ngram", "ngram_tree", "suffix", "recycling", "mix", "auto"):
        method = build_method(name, tiny_wide, smol_tokenizer, runner=runner, sized=False)
        method.engine.eos_ids = {EOS}
        assert method.run(prompt, 40, grammar=grammar).tokens == ref, f"{name} differs under {spec.kind}"


LIST_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}},
                                              "count": {"type": "integer"}}, "required": ["notes", "count"]}


@pytest.mark.parametrize("reserve", [24, 48])
def test_budget_closer_ends_valid_and_same_for_every_method(tiny_wide, smol_tokenizer, reserve):
    """With ``close_reserve`` an output the budget would cut ends with the grammar's completion: valid
    JSON, finish reason ``closed``, token-identical for plain decoding by hand, tree speculation,
    ngram and transformers' generate with the grammar processor (float32)."""
    n = 48
    prompt = encode_prompt(smol_tokenizer, "List some notes.")
    grammar = Grammar(ConstraintSpec.json_schema(LIST_SCHEMA), smol_tokenizer, 49152, [EOS], close_reserve=reserve)
    m, ids, ref = grammar.matcher(), list(prompt), []
    with torch.no_grad():
        while len(ref) < n:
            logits = tiny_wide(torch.tensor([ids])).logits[0, -1:]
            tok = int(mask_logits(logits, m.allowed(DraftTree())).argmax())
            assert tok != EOS, "the random model ended by itself: pick a prompt that runs past the budget"
            if n - len(ref) <= reserve and (path := m.closing_instead(tok, n - len(ref))) is not None:
                ref += path
                break
            ref.append(tok)
            m.commit([tok])
            ids.append(tok)
    assert ref[-1] == EOS and len(ref) <= n
    text = smol_tokenizer.decode(ref[:-1])
    jsonschema.validate(json.loads(text), LIST_SCHEMA)
    runner = HFRunner(tiny_wide)
    for drafter in (AutoregressiveDrafter(), OracleDrafter(prompt + ref, 49152, shape="tree", seed=3)):
        out = Engine(runner, drafter, smol_tokenizer, eos_token_ids=[EOS]).generate(prompt, n, grammar=grammar)
        assert out.tokens == ref and out.finish_reason == "closed", drafter.name
    method = build_method("ngram", tiny_wide, smol_tokenizer, runner=runner)
    method.engine.eos_ids = {EOS}
    assert method.run(prompt, n, grammar=grammar).tokens == ref
    hf = build_method("hf", tiny_wide, smol_tokenizer)
    hf.eos_ids = [EOS]
    out = hf.run(prompt, n, grammar=grammar)
    assert out.tokens == ref and out.finish_reason == "closed"
    without = Grammar(ConstraintSpec.json_schema(LIST_SCHEMA), smol_tokenizer, 49152, [EOS])
    assert Engine(runner, AutoregressiveDrafter(), smol_tokenizer,
                  eos_token_ids=[EOS]).generate(prompt, n, grammar=without).finish_reason == "length"


def test_oracle_drafts_are_pruned_and_forced_tokens_jump(tiny_wide, smol_tokenizer):
    """Illegal drafted tokens never reach the verifier, and forced JSON keys are drafted for free."""
    runner = HFRunner(tiny_wide)
    prompt = encode_prompt(smol_tokenizer, "A person, as JSON.")
    grammar = Grammar(SPECS[0], smol_tokenizer, 49152, [EOS])
    ref = reference_constrained_greedy(tiny_wide, grammar, prompt, 40, {EOS})
    seen: list[DraftTree] = []

    class Spy(OracleDrafter):
        def update(self, tokens, tree, acc, logits):
            seen.append(tree)

    engine = Engine(runner, Spy(prompt + ref, 49152, shape="tree", seed=5), smol_tokenizer, eos_token_ids=[EOS])
    out = engine.generate(prompt, 40, grammar=grammar)
    assert out.tokens == ref
    steps = out.steps
    assert sum(s.forced for s in steps) >= 3  # '{"name": "' is forced
    # every verified node was legal: replaying the committed prefix, each node validates
    assert all(s.drafted <= 64 for s in steps) and seen
    text = smol_tokenizer.decode(ref, skip_special_tokens=True)
    if ref[-1] == EOS:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
def test_smollm2_constrained_greedy_lossless(smollm2_f32):
    model, tok = smollm2_f32
    runner = HFRunner(model)
    cases = [
        ("Describe a person called Ann, aged 31, as JSON.", SPECS[0]),
        ("Is the sky blue? Answer yes or no and why.", SPECS[2]),
        ("What is the sentiment of 'I love this film'?", SPECS[3]),
    ]
    methods = {m: build_method(m, model, tok, runner=runner) for m in ("ar", "auto", "hf")}
    for text, spec in cases:
        prompt = encode_prompt(tok, text)
        grammar = methods["ar"].compile(spec)
        ref = reference_constrained_greedy(model, grammar, prompt, 48, methods["ar"].engine.eos_ids)
        for name, method in methods.items():
            out = method.run(prompt, 48, grammar=grammar)
            assert out.tokens == ref, f"{name} differs under {spec.kind} on {text!r}"
        if spec.kind == "json_schema" and ref[-1] in methods["ar"].engine.eos_ids:
            jsonschema.validate(json.loads(tok.decode(ref, skip_special_tokens=True)), PERSON)


# ---------------------------------------------------------------- sampling: the constrained distribution

def char_tokenizer():
    """A byte-level BPE tokenizer with 8 tokens: <eos>, a, b, c, d, ab, ba, cd."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "ab": 5, "ba": 6, "cd": 7}
    bpe = models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "a"), ("c", "d")])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


CHAR_GRAMMAR = ConstraintSpec.regex("[abc]+d")  # first token never d or <eos>; after d only <eos>
PROMPT = [1, 5, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.97)
N_SAMPLES = 10_000


def exact_constrained_joint(model, grammar) -> dict[tuple[int, int], float]:
    m = grammar.matcher()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1:]
        p1 = PARAMS.probs(mask_logits(logits, m.allowed(DraftTree())))[0]
        joint = {}
        for a in range(8):
            if p1[a] == 0:
                continue
            m.commit([a])
            logits = model(torch.tensor([PROMPT + [a]])).logits[0, -1:]
            p2 = PARAMS.probs(mask_logits(logits, m.allowed(DraftTree())))[0]
            m.m.rollback(1)
            for b in range(8):
                joint[(a, b)] = float(p1[a] * p2[b])
    return joint


class RandomDrafts(Drafter):
    """Point-mass drafts of random tokens (legal or not): chains, or trees with random siblings."""

    name = "random_drafts"

    def __init__(self, tree: bool, seed: int = 0):
        self.tree, self.rng = tree, random.Random(seed)

    def propose(self, tokens, budget):
        if not self.tree:
            return DraftTree.chain([self.rng.randrange(8) for _ in range(min(2, budget))])
        toks, parents = [], []
        for _ in range(self.rng.randint(1, 3)):
            toks.append(self.rng.randrange(8))
            parents.append(-1)
        for i in range(len(toks)):
            for _ in range(self.rng.randint(0, 2)):
                toks.append(self.rng.randrange(8))
                parents.append(i)
        return DraftTree(toks[:budget], parents[:budget])


def sample_pairs(engine, grammar, n=N_SAMPLES) -> Counter:
    counts = Counter()
    for seed in range(n):
        out = engine.generate(PROMPT, 2, PARAMS, seed=seed, grammar=grammar).tokens
        counts[tuple(out[:2]) if len(out) == 2 else (out[0], 0)] += 1
    return counts


def chi_square_p(counts: Counter, joint: dict, n: int) -> float:
    keys = [k for k, p in joint.items() if p * n >= 5]
    rest = 1.0 - sum(joint[k] for k in keys)
    observed = [counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)]
    expected = [joint[k] * n for k in keys] + [rest * n]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert sum(counts.values()) == n
    assert all(joint.get(k, 0) > 0 for k in counts), "a sample the constraint forbids"
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def char_setup():
    tok = char_tokenizer()
    model = tiny_llama(seed=3, vocab=8, logit_scale=8.0)
    draft = tiny_llama(seed=11, vocab=8, logit_scale=4.0)
    grammar = Grammar(CHAR_GRAMMAR, tok, 8, [0])
    return tok, model, draft, grammar, exact_constrained_joint(model, grammar)


@pytest.mark.parametrize("drafter", ["ar", "tree", "draft_model"])
def test_constrained_sampling_distribution(char_setup, drafter):
    tok, model, draft, grammar, joint = char_setup
    d = {"ar": lambda: AutoregressiveDrafter(), "chain": lambda: RandomDrafts(False),
         "tree": lambda: RandomDrafts(True), "draft_model": lambda: DraftModelDrafter(draft, num_draft=2)}[drafter]()
    engine = Engine(HFRunner(model), d, tok, eos_token_ids=[0])
    p = chi_square_p(sample_pairs(engine, grammar), joint, N_SAMPLES)
    assert p > 1e-3, f"{drafter}: constrained samples do not follow the constrained distribution (p={p:.2g})"


def test_unrestricted_draft_q_is_detected(char_setup, monkeypatch):
    """Control: verifying a draft model's tokens against its unconstrained q biases the output."""
    tok, model, draft, grammar, joint = char_setup
    monkeypatch.setattr("speculum.constrain.guide.restrict_draft_probs", lambda tree, allowed: tree)
    engine = Engine(HFRunner(model), DraftModelDrafter(draft, num_draft=2), tok, eos_token_ids=[0])
    n = 3000  # the bias is large: p ~ 1e-100 at 10k samples
    p = chi_square_p(sample_pairs(engine, grammar, n), joint, n)
    assert p < 1e-6, f"the broken verifier was not detected (p={p:.2g})"


# ---------------------------------------------------------------- bad constraints

@pytest.mark.parametrize("spec, message", [
    (ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "invalid JSON schema"),
    (ConstraintSpec.json_schema("{not json"), "not valid JSON"),
    (ConstraintSpec.json_schema([1, 2]), "must be a JSON object"),
    (ConstraintSpec.regex("(unclosed"), "invalid regex"),
    (ConstraintSpec.choice([]), "non-empty list"),
    (ConstraintSpec.lark("start: undefined_rule\n"), "cannot be compiled"),
    (ConstraintSpec("xml", "<a/>"), "unknown constraint kind"),
])
def test_bad_constraints_are_refused(char_setup, spec, message):
    tok = char_setup[0]
    with pytest.raises(SpeculumError, match=message):
        Grammar(spec, tok, 8, [0])


def test_grammar_width_must_match_the_logits(char_setup, tiny_wide, smol_tokenizer):
    grammar = Grammar(ConstraintSpec.json_object(), smol_tokenizer, 49153, [EOS])
    engine = Engine(HFRunner(tiny_wide), AutoregressiveDrafter(), smol_tokenizer, eos_token_ids=[EOS])
    with pytest.raises(SpeculumError, match="wide"):
        engine.generate([1, 2, 3], 4, grammar=grammar)


def test_mask_width_exceeds_tokenizer_vocab(smol_tokenizer):
    """Logits wider than the vocabulary: the padding ids are never allowed."""
    grammar = Grammar(ConstraintSpec.json_object(), smol_tokenizer, 49152 + 64, [EOS])
    allowed = grammar.matcher().allowed(DraftTree())
    assert allowed.shape == (1, 49152 + 64)
    assert not allowed[0, 49152:].any() and allowed[0].any()


def test_matcher_prune_keeps_legal_subtree(smol_tokenizer):
    from speculum.tree import TreeBuilder

    grammar = Grammar(ConstraintSpec.choice(["yes", "no"]), smol_tokenizer, 49152, [EOS])
    m = grammar.matcher()
    yes = smol_tokenizer.encode("yes", add_special_tokens=False)
    no = smol_tokenizer.encode("no", add_special_tokens=False)
    bad = smol_tokenizer.encode("maybe", add_special_tokens=False)[0]
    b = TreeBuilder()
    end = b.add_path(yes, [1.0] * len(yes))
    b.add(end, EOS, 1.0)
    b.add(b.add(end, bad, 1.0), EOS, 1.0)  # "yes" then an illegal token and a child of it
    b.add(-1, bad, 1.0)
    b.add_path(no, [1.0] * len(no))
    pruned = m.prune(b.build())
    assert bad not in pruned.tokens
    assert pruned.tokens == yes + [EOS] + no
    allowed = m.allowed(pruned)  # [n + 1, V]
    assert allowed.shape == (len(pruned) + 1, 49152)
    assert allowed[0, yes[0]] and allowed[0, no[0]] and not allowed[0, EOS] and not allowed[0, bad]
    assert allowed[len(yes), EOS] and allowed[len(yes)].sum() == 1  # after "yes" only the end
    assert allowed[len(yes) + 1].all()  # the row after EOS is never used
    assert m.prune(b.build()).tokens == pruned.tokens  # the matcher's state was left unchanged


def test_strict_schema_only_tightens():
    from speculum.constrain.spec import strict_schema

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "properties": {"type": "integer"}},
              "required": ["a", "z"], "$defs": {"x": {"properties": {"c": {}}}}}
    s = strict_schema(schema)
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["z"] == {}  # required but undescribed: any value, still allowed
    assert "additionalProperties" not in s["properties"]["properties"]  # a property named "properties"
    assert s["$defs"]["x"]["additionalProperties"] is False
    assert schema.get("additionalProperties") is None  # the input is not modified
    jsonschema.validate({"a": {"b": "x"}, "z": 3}, s)
    jsonschema.validate({"a": {"b": "x"}, "z": 3}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": {}, "z": 1, "extra": 1}, s)
    assert s["properties"]["properties"]["maximum"] == 2**53 - 1  # unbounded integers get I-JSON's range
    bounded = strict_schema({"type": "integer", "minimum": 0})
    assert "maximum" not in bounded
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert strict_schema(both) == both  # closing each branch would make {"a", "b"} unsatisfiable
