"""cross_vocab: a draft model with another tokenizer drafts through text (SLEM / OmniDraft).

Toy tokenizers stand in for real ones: one char per id, chars with merged pairs, the same chars
under other ids. Greedy output must be ar's, sampled output the target's distribution, and the
drafts what the rule says.
"""

from __future__ import annotations

import random
import string
from collections import Counter

import pytest
import torch
from conftest import TINY_VOCAB, tiny_gemma3, tiny_llama
from test_sampling import chi2_pvalue

from speculum.drafters.ar import AutoregressiveDrafter
from speculum.drafters.cross_vocab import CrossVocabDrafter
from speculum.drafting.vocab_bridge import ContextTranslator, continuation_ids, stable_prefix, to_other_vocab
from speculum.engine import Engine
from speculum.errors import SpeculumError
from speculum.methods import build_method
from speculum.runners import NativeRunner
from speculum.sampling import SamplingParams
from speculum.tree import DraftTree
from speculum.verify import Acceptance, Verifier

CHARS = string.printable[:TINY_VOCAB - 1]  # 95 printable chars (digits, letters, punctuation, space)
PAIRS = ["th", "he", "at", " c", "in", "er", "an", " t", "e ", "on"]


class ToyTokenizer:
    """Greedy longest-match tokenizer over ``pieces`` (``specials``: names of special pieces; the
    first is its BOS, put first by ``encode``); ``order`` permutes the ids."""

    eos_token_id = None

    def __init__(self, pieces: list[str], specials: tuple[str, ...] = ("<bos>",), seed: int | None = None,
                 eos: str | None = None):
        pieces = list(specials) + pieces
        ids = list(range(len(pieces)))
        if seed is not None:
            random.Random(seed).shuffle(ids)
        self.piece = {i: p for i, p in zip(ids, pieces, strict=True)}
        self.vocab = {p: i for i, p in self.piece.items()}
        self.all_special_ids = [self.vocab[s] for s in specials]
        self.bos_token_id = self.vocab[specials[0]]
        if eos is not None:
            self.eos_token_id = self.vocab[eos]
        self.longest = max(len(p) for p in pieces)

    def __len__(self) -> int:
        return len(self.piece)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.piece[int(i)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [self.bos_token_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            for n in range(self.longest, 0, -1):
                if text[i:i + n] in self.vocab and self.vocab[text[i:i + n]] not in self.all_special_ids:
                    out.append(self.vocab[text[i:i + n]])
                    i += n
                    break
            else:
                i += 1  # unknown char: dropped
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.piece[int(i)] for i in ids
                       if not (skip_special_tokens and int(i) in self.all_special_ids))


def char_tokenizer() -> ToyTokenizer:
    return ToyTokenizer(list(CHARS))  # 96 ids: <bos> then one char each


def pair_tokenizer(seed: int = 1) -> ToyTokenizer:
    return ToyTokenizer(list(CHARS) + PAIRS, specials=("<s>", "</s>"), seed=seed, eos="</s>")


def permuted_copy(model, perm: list[int]):
    """``model`` over permuted ids: row ``perm[i]`` of its embedding and LM head is row ``i``'s."""
    twin = tiny_llama(vocab=len(perm))
    twin.load_state_dict(model.state_dict())
    index = torch.argsort(torch.tensor(perm))  # new row j comes from old row index[j]
    with torch.no_grad():
        twin.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[index])
        twin.lm_head.weight.copy_(model.lm_head.weight[index])
    return twin


def prompts(n: int = 3, length: int = 12) -> list[list[int]]:
    rng = random.Random(7)
    return [[0] + [rng.randrange(1, TINY_VOCAB) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3])
def test_greedy_equals_ar_across_tokenizers(make_target):
    """Target: one char per id; draft: another model whose tokenizer merges pairs and numbers ids otherwise."""
    target, draft_tok = make_target(seed=1), pair_tokenizer()
    runner = NativeRunner(target)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    drafter = CrossVocabDrafter(tiny_llama(seed=2, vocab=len(draft_tok)), char_tokenizer(), draft_tok)
    cross = Engine(runner, drafter, eos_token_ids=[])
    for prompt in prompts():
        assert cross.generate(prompt, 32).tokens == ar.generate(prompt, 32).tokens


def test_a_draft_that_is_the_target_in_other_ids_is_accepted():
    """The draft model is the target with its ids permuted (and its own BOS id): every stable
    drafted id is the target's argmax, so steps commit several tokens, and the output is ar's."""
    target_tok = char_tokenizer()
    draft_tok = ToyTokenizer(list(CHARS), seed=5)
    perm = [draft_tok.vocab[target_tok.piece[i]] for i in range(len(target_tok))]
    target = tiny_llama(seed=3, logit_scale=4.0)
    drafter = CrossVocabDrafter(permuted_copy(target, perm), target_tok, draft_tok, num_draft=5)
    runner = NativeRunner(target)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    cross = Engine(runner, drafter, eos_token_ids=[])
    for prompt in prompts(2):
        out = cross.generate(prompt, 40)
        assert out.tokens == ar.generate(prompt, 40).tokens
        assert out.mean_accepted > 3.0  # a chain of k chars keeps k - 1 stable ids, all accepted


def test_batched_requests_equal_solo_ar():
    """Requests of cross_vocab (forks of one drafter) share batches, joining and leaving mid-way."""
    from speculum.batching import Batcher, BatchRequest

    target, draft_tok = tiny_llama(seed=1), pair_tokenizer()
    runner = NativeRunner(target)
    ar = Engine(runner, AutoregressiveDrafter(), eos_token_ids=[])
    cross = Engine(runner, CrossVocabDrafter(tiny_llama(seed=2, vocab=len(draft_tok)), char_tokenizer(), draft_tok),
                   eos_token_ids=[])
    reqs = [BatchRequest(cross, p, n) for p, n in zip(prompts(5), [7, 30, 12, 25, 18], strict=True)]
    got = [r.tokens for r in Batcher(runner, max_batch=3).run(reqs)]
    assert got == [ar.generate(r.prompt_ids, r.max_new_tokens).tokens for r in reqs]


def test_conversion_at_a_word_boundary():
    """The committed tail is re-encoded with the drafted text; where it comes back changed (its last
    id is part of a longer piece), the text is encoded alone."""
    tok = pair_tokenizer()
    ids = tok.encode
    # "a c" + "at sat": "a", " c" come back unchanged; what follows continues them
    assert continuation_ids(tok, ids("a c", False), "at sat") == ids("at sat", False)
    assert [tok.piece[i] for i in continuation_ids(tok, ids("a c", False), "at sat")] == ["at", " ", "s", "at"]
    # "t" + "he": together "th", "e"; the committed "t" stays, so "he" alone follows it
    assert [tok.piece[i] for i in continuation_ids(tok, ids("t", False), "he")] == ["he"]
    # nothing merges across a special id
    assert continuation_ids(tok, [tok.vocab["t"], tok.vocab["</s>"]], "he", frozenset(tok.all_special_ids)) \
        == ids("he", False)
    assert stable_prefix([1, 2, 3], [1, 2, 4, 5]) == [1, 2]


def test_context_moves_to_the_other_vocabulary():
    source, other = char_tokenizer(), pair_tokenizer()
    ids = source.encode("the cat") + [source.vocab["<bos>"]] + source.encode("in", False)
    specials = {source.vocab["<bos>"]: None}  # no special of that spelling in `other`
    # other's BOS first, then the text between specials, each part encoded on its own
    want = [other.vocab["<s>"]] + other.encode("the cat", False) + other.encode("in", False)
    assert to_other_vocab(ids, source, other, specials) == want


def test_context_translation_is_incremental():
    """The translator re-encodes only the recent ids and gives what translating everything gives
    (pieces that never cross a space, so a cut at a word start changes nothing)."""
    source = char_tokenizer()
    other = ToyTokenizer(list(CHARS) + ["th", "he", "at", "in"], specials=("<s>",), seed=3)
    specials = {source.vocab["<bos>"]: None}
    translate = ContextTranslator(source, other, specials, keep=8, freeze_at=16)
    ids = source.encode("the cat sat on the mat and then the hat went in " * 3)
    for n in range(1, len(ids) + 1):
        assert translate(ids[:n]) == to_other_vocab(ids[:n], source, other, specials)
    assert len(translate.frozen) > len(ids) - 16 - 8
    assert translate(ids[:5]) == to_other_vocab(ids[:5], source, other, specials)  # another sequence


def test_only_ids_that_a_longer_draft_keeps_are_proposed():
    """Draft (one char per id) drafts "c", "a", "t"; in the target's vocabulary (pairs) "cat" is
    "c", "at" and "ca" is "c", "a": "at" may not be what a finished word gives, so only "c" is
    proposed; after the draft's end token the whole text is final."""
    target_tok = pair_tokenizer()
    draft_tok = ToyTokenizer(list(CHARS), specials=("<s>", "</s>"), eos="</s>")
    drafter = CrossVocabDrafter(tiny_llama(vocab=len(draft_tok)), target_tok, draft_tok)
    committed = target_tok.encode("a ", True)
    context = draft_tok.encode("a ", True)
    drafted = draft_tok.encode("cat", False)
    assert [target_tok.piece[i] for i in drafter.target_ids(committed, context, drafted)] == ["c"]
    ended = drafted + [draft_tok.vocab["</s>"]]
    assert [target_tok.piece[i] for i in drafter.target_ids(committed, context, ended)] == ["c", "at"]


def test_draft_length_adapts():
    drafter = CrossVocabDrafter(tiny_llama(vocab=len(pair_tokenizer())), char_tokenizer(), pair_tokenizer(),
                                num_draft=4, max_draft=8)
    drafter.reset([0, 5], SamplingParams(), None)
    tree = DraftTree.chain([3, 4, 5])
    drafter.update([], tree, Acceptance([0, 1, 2], [3, 4, 5, 6]))
    assert drafter.k == 6
    drafter.update([], tree, Acceptance([0], [3, 9]))
    assert drafter.k == 5


def test_registry_and_checks():
    target_tok, draft_tok = char_tokenizer(), pair_tokenizer()
    target, draft = tiny_llama(seed=1), tiny_llama(seed=2, vocab=len(draft_tok))
    method = build_method("cross_vocab", target, target_tok, draft, draft_tok)
    prompt = prompts(1)[0]
    ar = build_method("ar", target, target_tok)
    assert method.run(prompt, 16).tokens == ar.run(prompt, 16).tokens
    with pytest.raises(SpeculumError, match="tokenizer"):
        build_method("draft_model", target, target_tok, draft, draft_tok)  # still refuses
    with pytest.raises(SpeculumError, match="needs a draft model"):
        build_method("cross_vocab", target, target_tok)
    with pytest.raises(SpeculumError, match="num_draft"):
        build_method("cross_vocab", target, target_tok, draft, draft_tok, num_draft=1)


# --- sampling: the target's distribution, whatever the draft ---

VOCAB = 8
SMALL = "abcdefg"  # target: <bos> + 7 chars
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.97)
PROMPT = [1, 5, 2]


class TrustingVerifier(Verifier):
    """Wrong on purpose: takes a drafted token whenever the target gives it probability 0.1 or more."""

    def accept_keyed(self, tree, logits, position):
        path, row = [], 0
        for node, tok in enumerate(tree.tokens):
            if float(self.params.probs(logits[row])[tok]) < 0.1:
                break
            path.append(node)
            row = node + 1
        return Acceptance(path, tree.tokens[:len(path)] + [self.keyed_token(self.params.probs(logits[row]),
                                                                               position + len(path))])


def small_setup():
    target = tiny_llama(seed=3, vocab=VOCAB, logit_scale=8.0)
    target_tok = ToyTokenizer(list(SMALL))
    draft_tok = ToyTokenizer(list(SMALL) + ["ab", "ca", "fe"], specials=("<s>",), seed=2)
    draft = tiny_llama(seed=4, vocab=len(draft_tok), logit_scale=5.0)
    return target, target_tok, draft, draft_tok


def exact_joint(model) -> dict[tuple[int, int], float]:
    with torch.no_grad():
        p1 = PARAMS.probs(model(torch.tensor([PROMPT])).logits[0, -1])
        p2 = PARAMS.probs(model(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1])
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


@pytest.mark.parametrize("verifier", [Verifier, TrustingVerifier])
def test_sampled_output_is_the_targets_distribution(verifier):
    """Keyed sampling of the point-mass cross-vocabulary drafts keeps p (chi-square on the first two
    tokens); a verifier that trusts likely drafts bends it and fails the same test."""
    target, target_tok, draft, draft_tok = small_setup()
    drafter = CrossVocabDrafter(draft, target_tok, draft_tok, num_draft=3)
    engine = Engine(NativeRunner(target), drafter, eos_token_ids=[], verifier_cls=verifier)
    n = 2000 if verifier is Verifier else 800  # the broken one fails at p < 1e-12 from 800
    counts = Counter(tuple(engine.generate(PROMPT, 2, PARAMS, seed=100 + i).tokens) for i in range(n))
    p = chi2_pvalue(counts, exact_joint(target), n)
    if verifier is Verifier:
        assert p > 1e-3, f"chi-square p = {p:.2e}"
        assert engine.generate(PROMPT, 40, PARAMS, seed=1).mean_accepted > 1.05  # drafts were accepted
    else:
        assert p < 1e-6, f"the trusting verifier passed: p = {p:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["gemma_drafts_for_smollm2", "smollm2_drafts_for_gemma"])
def test_packaged_models_across_tokenizers(smollm2_f32, gemma3_f32, direction):
    """Greedy output equals ar's on the packaged models (float32), each drafting for the other."""
    from speculum.prompts import encode_prompt

    (target, ttok), (draft, dtok) = (smollm2_f32, gemma3_f32) if direction.startswith("gemma") \
        else (gemma3_f32, smollm2_f32)
    ids = encode_prompt(ttok, "List three facts about the Moon.", None)
    ar = build_method("ar", target, ttok).run(ids, 24)
    out = build_method("cross_vocab", target, ttok, draft, dtok).run(ids, 24)
    assert out.tokens == ar.tokens
    assert out.mean_accepted > 1.2  # the other model's drafts are accepted at times


def test_cli_asks_for_the_draft_model(capsys):
    from speculum.cli import main

    assert main(["generate", "--prompt", "hi", "--method", "cross_vocab"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speculum: error:") and "needs a draft model" in err and "Traceback" not in err
