"""RULER-style synthetic long-context tasks, generated offline from fixed seeds.

Every haystack is filler text built here (no download). Tasks, after RULER (Hsieh et al., 2024):

- ``niah_single``: one needle "One of the special magic {kind}s for {key} is: {value}." in filler;
  ask for it. Values are numbers (7 digits), words or UUIDs (chosen per run; numbers by default).
- ``niah_multikey``: four needles with different keys; ask for one of them.
- ``niah_multivalue``: four values for the same key; ask for all of them.
- ``niah_multiquery``: four needles; ask for two keys' values.
- ``passkey``: "The pass key is N. Remember it. N is the pass key." in repeated filler.
- ``variable_tracking``: a chain of assignments ``VAR A = 12345``, ``VAR B = VAR A``, ... spread
  through the filler; ask which variables hold the value.
- ``common_words``: a numbered list of words in which ten occur several times and the rest a few;
  ask for the ten most common.

A sample is scored by RULER's ``string_match_all``: the fraction of its expected strings found
(case-insensitively) in the output. Prompts end with an answer prefix ("The special magic number
for ... is"), so an instruct model answers instead of explaining the task.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "passkey",
         "variable_tracking", "common_words")

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
WORDS = ("apple", "river", "candle", "marble", "violin", "harbor", "meadow", "lantern", "pepper", "saddle",
         "thunder", "walnut", "copper", "falcon", "garden", "island", "jacket", "kettle", "ladder", "mirror",
         "needle", "orchid", "pillow", "quartz", "ribbon", "silver", "tunnel", "velvet", "window", "yellow",
         "anchor", "bridge", "cactus", "dragon", "engine", "forest", "glacier", "hammer", "insect", "jungle",
         "kitten", "lemon", "magnet", "nectar", "oyster", "parrot", "rabbit", "spider", "tomato", "umbrella",
         "basket", "cotton", "donkey", "feather", "ginger", "helmet", "iron", "juniper", "koala", "lizard")
KEYS = ("hungry-pelican", "quiet-volcano", "bright-compass", "frozen-orchard", "silent-lighthouse",
        "crimson-glacier", "gentle-harvest", "rapid-canyon", "hollow-meadow", "golden-tundra",
        "wild-archive", "lucky-satellite", "ancient-teapot", "brave-mosaic", "curious-lantern")
PASSKEY_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it "
                 "and memorize it. I will quiz you about it. ")
VALUE_KINDS = ("number", "word", "uuid")


@dataclass
class LongTask:
    """One sample: ``context`` (the haystack), ``question`` (asked after it), ``answer_prefix`` (opens
    the answer), ``expected`` (strings that must all appear in the output)."""

    task: str
    length: int  # target prompt length in tokens
    seed: int
    context: str
    question: str
    answer_prefix: str
    expected: list[str]
    max_new_tokens: int = 32
    meta: dict = field(default_factory=dict)


def string_match_all(output: str, expected: list[str]) -> float:
    """RULER's metric: the fraction of ``expected`` found in ``output`` (case-insensitive)."""
    low = output.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "word":
        return rng.choice(WORDS)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _haystack(sentences_needed: int) -> list[str]:
    """Filler sentences (RULER's "noise" haystack)."""
    parts = [p.strip() + "." for p in NOISE.split(".") if p.strip()]
    return [parts[i % len(parts)] for i in range(sentences_needed)]


def _insert(filler: list[str], needles: list[str], rng: random.Random, depths: list[float] | None = None) -> str:
    """Place ``needles`` at (random or given) depths among the filler sentences."""
    out = list(filler)
    spots = depths or sorted(rng.uniform(0.05, 0.95) for _ in needles)
    for needle, depth in sorted(zip(needles, spots), key=lambda x: -x[1]):
        out.insert(int(depth * len(out)), needle)
    return " ".join(out)


def make_task(task: str, length: int, seed: int, count_tokens, values: tuple[str, ...] = ("number",)) -> LongTask:
    """Build one sample of about ``length`` prompt tokens; ``count_tokens(text) -> int`` measures text.

    ``values``: the needle value kinds (``number``, ``word``, ``uuid``) that samples cycle through
    by seed (RULER's niah variants use numbers, words or UUIDs); passkey and variable tracking
    always use numbers."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if not values or any(v not in VALUE_KINDS for v in values):
        raise ValueError(f"value kinds are {', '.join(VALUE_KINDS)}")
    kind = values[seed % len(values)]
    rng = random.Random(f"{task}-{length}-{seed}-{kind}")
    max_new = 48 if kind == "uuid" else 32
    keys = rng.sample(KEYS, 4)
    if task == "passkey":
        key = str(rng.randrange(10_000, 100_000))
        needles = [f"The pass key is {key}. Remember it. {key} is the pass key."]
        question, prefix, expected, max_new = "What is the number of the pass key?", "The pass key number is", [key], 16
    elif task.startswith("niah"):
        # the needles: one key's value (single), one key's four values (multivalue), or four keys' values
        needle_keys = {"niah_single": keys[:1], "niah_multivalue": keys[:1] * 4}.get(task, keys)
        values = [_value(rng, kind) for _ in needle_keys]
        needles = [f"One of the special magic {kind}s for {k} is: {v}." for k, v in zip(needle_keys, values)]
        if task == "niah_multivalue":
            question = f"What are all the special magic {kind}s for {keys[0]} mentioned in the provided text?"
            prefix, expected = f"The special magic {kind}s for {keys[0]} mentioned in the provided text are", values
            max_new *= 3
        elif task == "niah_multiquery":
            a, b = rng.sample(range(4), 2)
            question = (f"What are the special magic {kind}s for {keys[a]} and {keys[b]} mentioned in the "
                        "provided text?")
            prefix = f"The special magic {kind}s for {keys[a]} and {keys[b]} mentioned in the provided text are"
            expected, max_new = [values[a], values[b]], max_new * 2
        else:  # one key asked: the only one (single) or one of four (multikey)
            asked = rng.randrange(4) if task == "niah_multikey" else 0
            question = f"What is the special magic {kind} for {keys[asked]} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {keys[asked]} mentioned in the provided text is"
            expected = [values[asked]]
    elif task == "variable_tracking":
        value = str(rng.randrange(10_000, 100_000))
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        question = f"Find all variables that are assigned the value {value} in the text above."
        prefix, expected = f"Answer: the variables assigned the value {value} are:", names
    else:  # common_words
        common = rng.sample(WORDS, 10)
        rare = [w for w in WORDS if w not in common]
        question = "What are the 10 most common words in the above list?"
        prefix, expected, max_new = "Answer: the 10 most common words in the list are:", common, 64
        words: list[str] = []
        while count_tokens(" ".join(f"{i + 1}. {w}" for i, w in enumerate(words))) < length - 120:
            block = [w for w in common for _ in range(3)] + rng.sample(rare, 10)
            rng.shuffle(block)
            words += block
        context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return LongTask(task, length, seed, context, question, prefix, expected, max_new, {"kind": "words"})
    base = count_tokens(" ".join(needles)) + count_tokens(question + " " + prefix) + 60  # + template
    per_sentence = count_tokens(" ".join(_haystack(60))) / 60
    filler = _haystack(max(1, int((length - base) / per_sentence)))
    context = _insert(filler, needles, rng)
    if task == "passkey":
        context = PASSKEY_INTRO + context
    return LongTask(task, length, seed, context, question, prefix, expected, max_new, {"kind": kind})
