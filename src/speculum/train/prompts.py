"""The training prompt set for self-distillation: reproducible from a seed, diverse, never Spec-Bench.

Eight kinds of prompt, each from templates filled with topics listed here, numbers drawn from the
seed, or text shipped inside installed packages (the docstrings and source of Python's standard
library, which every installation carries):

- ``chat``: advice and how-to questions;
- ``writing``: stories, poems, emails, descriptions on a topic;
- ``translation``: sentences built from parts, into five languages;
- ``summary``: a standard-library docstring to summarise;
- ``qa``: explain a concept, compare two things;
- ``math``: word problems and equations with drawn numbers;
- ``code``: write a function for a task, or explain a standard-library function's source;
- ``retrieval``: answer a question about a passage (a docstring).

``self``-written prompts (the model's own questions about a subject) are added by the data
generator, which asks the model for them first (:func:`question_requests`).

Example: ``training_prompts(3, seed=0)`` -> three strings, one of three kinds, the same on every
machine with the same Python version (the standard library's text is part of the recipe).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re

TOPICS = [
    "the ocean", "a lighthouse keeper", "autumn in the city", "a lost robot", "time travel", "a mountain village",
    "friendship", "a rainy train journey", "the first day at a new job", "an old library", "a desert storm",
    "a chess tournament", "a bakery at dawn", "space exploration", "a forgotten garden", "the night market",
    "a family recipe", "learning to swim", "a volcano", "a street musician", "migrating birds", "a winter cabin",
    "a small startup", "a museum heist", "the last bookstore", "a river delta", "a solar eclipse",
    "a marathon runner", "an abandoned factory", "a coral reef", "a music festival", "a wise old tree",
]
ADVICE = [
    "improve my sleep", "learn a new language quickly", "save money on groceries", "prepare for a job interview",
    "start running as a beginner", "keep houseplants alive", "write a good cover letter", "reduce stress at work",
    "organise my week", "make friends in a new city", "learn to cook healthy meals", "give a good presentation",
    "study for exams effectively", "negotiate a salary", "start a vegetable garden", "stay focused while working from home",
    "plan a budget trip to Europe", "teach a child to read", "choose a laptop for programming", "train a puppy",
    "get better at public speaking", "deal with procrastination", "write clear emails", "build a daily habit",
    "prepare for a long hike", "improve my handwriting", "back up my photos", "decorate a small apartment",
]
CONCEPTS = [
    "photosynthesis", "inflation", "machine learning", "the water cycle", "blockchain", "natural selection",
    "compound interest", "the greenhouse effect", "quantum entanglement", "supply and demand", "vaccination",
    "plate tectonics", "a neural network", "the immune system", "democracy", "black holes", "recursion",
    "the stock market", "climate change", "DNA replication", "the Pythagorean theorem", "electric cars",
    "the Renaissance", "public key cryptography", "gravity", "the French Revolution", "antibiotics",
    "operating systems", "opportunity cost", "the Internet", "probability", "renewable energy", "the Roman Empire",
    "a hash table", "entropy", "tides", "the scientific method", "cloud computing", "impressionism", "jazz",
]
PAIRS = [
    ("cats", "dogs"), ("Python", "JavaScript"), ("renting", "buying a home"), ("trains", "planes"),
    ("solar power", "wind power"), ("tea", "coffee"), ("e-books", "paper books"), ("SQL", "NoSQL databases"),
    ("living in a city", "living in the countryside"), ("running", "cycling"), ("TCP", "UDP"),
    ("stocks", "bonds"), ("classical music", "rock music"), ("remote work", "office work"),
]
WRITING = ["a short story", "a poem", "a haiku sequence", "a blog post", "a product description for a gadget inspired by",
           "a diary entry", "a news report", "a speech", "a letter to a friend", "a dialogue between two characters"]
EMAILS = ["asking a landlord to fix the heating", "thanking a colleague for their help", "declining a meeting politely",
          "requesting a deadline extension", "inviting neighbours to a street party", "complaining about a late delivery",
          "introducing yourself to a new team", "following up after a job interview"]
SUBJECTS = ["The teacher", "My brother", "The old man", "Our neighbour", "The children", "A tourist", "The doctor",
            "My friend", "The manager", "The cat"]
VERBS = ["is reading", "bought", "forgot", "is looking for", "found", "likes", "cleaned", "painted", "lost", "needs"]
OBJECTS = ["a red umbrella", "the train tickets", "a book about history", "fresh bread", "the keys to the house",
           "a new bicycle", "the letter from the bank", "an old photograph", "a cup of coffee", "the map of the city"]
PLACES = ["at the station", "in the kitchen", "near the river", "before breakfast", "after the concert", "yesterday",
          "every morning", "at the market", "during the holidays", "in the garden"]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese"]
CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number", "merges two sorted lists",
    "counts the words in a text file", "removes duplicates from a list while keeping order", "flattens a nested list",
    "computes the greatest common divisor of two numbers", "validates an email address with a regular expression",
    "reverses the words in a sentence", "finds the most common element in a list", "converts Celsius to Fahrenheit",
    "checks whether a number is prime", "parses a CSV line into fields", "computes the median of a list",
    "implements binary search", "groups a list of words by their first letter", "rotates a matrix by 90 degrees",
    "returns the longest common prefix of several strings", "implements a simple stack class",
    "reads a JSON file and returns the keys", "computes a running average", "counts vowels in a string",
    "sorts a list of dictionaries by a key", "checks whether brackets in a string are balanced",
]
CODE_LANGS = ["Python", "JavaScript", "Rust", "Go", "C"]
STDLIB = ["json", "csv", "re", "collections", "itertools", "functools", "heapq", "bisect", "textwrap", "string",
          "random", "statistics", "fractions", "decimal", "datetime", "calendar", "pathlib", "shutil", "tempfile",
          "argparse", "logging", "unittest", "difflib", "zipfile", "gzip", "hashlib", "secrets", "uuid", "html",
          "urllib.parse", "email.message", "http.client", "sqlite3", "threading", "queue", "contextlib", "abc",
          "dataclasses", "enum", "typing", "operator", "copy", "pprint", "shlex", "glob", "fnmatch", "base64",
          "struct", "array", "weakref", "inspect", "ast", "dis", "tokenize", "timeit", "traceback", "warnings"]
KINDS = ("chat", "writing", "translation", "summary", "qa", "math", "code", "retrieval")


def _modules():
    """``(name, module)`` for each module of :data:`STDLIB` this Python has."""
    for mod_name in STDLIB:
        try:
            yield mod_name, importlib.import_module(mod_name)
        except ImportError:
            continue


def _passages() -> list[tuple[str, str]]:
    """``(name, text)``: paragraphs of the standard library's docstrings (40..900 characters)."""
    out = []
    for mod_name, mod in _modules():
        objs = [(mod_name, mod)] + [(f"{mod_name}.{n}", o) for n, o in sorted(vars(mod).items())
                                    if not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o))
                                    and getattr(o, "__module__", None) == mod.__name__]
        for name, obj in objs:
            doc = inspect.getdoc(obj) or ""
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                if 120 <= len(para) <= 900 and not para.startswith((">>>", "..")):
                    out.append((name, para))
    return out


def _functions() -> list[tuple[str, str]]:
    """``(name, source)``: small pure-Python standard-library functions (4..30 lines)."""
    out = []
    for mod_name, mod in _modules():
        for n, o in sorted(vars(mod).items()):
            if inspect.isfunction(o) and o.__module__ == mod.__name__ and not n.startswith("_"):
                try:
                    src = inspect.getsource(o)
                except (OSError, TypeError):
                    continue
                if 4 <= src.count("\n") <= 30:
                    out.append((f"{mod_name}.{n}", src.strip()))
    return out


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 500)
    forms = [
        f"A shop sells notebooks for ${a} each. Maria buys {b} notebooks and pays with ${a * b + c}. How much change does she get?",
        f"Solve for x: {a}x + {b} = {a * rng.randint(1, 20) + b}. Show your steps.",
        f"A train travels {c} km in {b} hours. What is its average speed? Then, how far does it go in {a} hours?",
        f"What is {a * 7} multiplied by {b}? Explain how to do it in your head.",
        f"A recipe needs {b} eggs for {a} people. How many eggs are needed for {a * 3} people?",
        f"The price of a jacket is ${c}. It is discounted by {rng.choice([10, 15, 20, 25, 30])}%. What is the new price?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"Tom has {c} marbles. He gives {b} to each of his {rng.randint(2, 6)} friends. How many does he have left?",
        f"Is {rng.randrange(101, 999, 2)} a prime number? Explain how you check.",
        f"What is the sum of the integers from 1 to {c}?",
    ]
    return rng.choice(forms)


def training_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct ``(kind, prompt)`` pairs, cycling over :data:`KINDS`, drawn with ``seed``."""
    rng = random.Random(seed)
    passages, functions = _passages(), _functions()
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    i = 0
    while len(out) < n and i < 50 * n:  # unique prompts (small template spaces repeat)
        kind = KINDS[i % len(KINDS)]
        i += 1
        if kind == "chat":
            text = rng.choice(["How can I {x}?", "What are some tips to {x}?", "I want to {x}. Where should I start?",
                               "Give me a step-by-step plan to {x}."]).format(x=rng.choice(ADVICE))
        elif kind == "writing":
            if rng.random() < 0.3:
                text = f"Write an email {rng.choice(EMAILS)}."
            else:
                text = f"Write {rng.choice(WRITING)} about {rng.choice(TOPICS)}."
        elif kind == "translation":
            s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."
            s2 = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
            text = f"Translate into {rng.choice(LANGUAGES)}: {s} {s2}"
        elif kind == "summary":
            _, para = rng.choice(passages)
            text = rng.choice(["Summarize the following text in two sentences:\n\n{p}",
                               "Give a one-paragraph summary of this text:\n\n{p}",
                               "What are the key points of the following passage?\n\n{p}"]).format(p=para)
        elif kind == "qa":
            if rng.random() < 0.3:
                a, b = rng.choice(PAIRS)
                text = f"What are the main differences between {a} and {b}?"
            else:
                text = rng.choice(["What is {c}?", "Explain {c} to a beginner.", "Why is {c} important?",
                                   "How does {c} work?"]).format(c=rng.choice(CONCEPTS))
        elif kind == "math":
            text = _math(rng)
        elif kind == "code":
            if rng.random() < 0.35 and functions:
                name, src = rng.choice(functions)
                text = f"Explain what this function from Python's {name.split('.')[0]} module does:\n\n{src}"
            else:
                text = f"Write a {rng.choice(CODE_LANGS)} function that {rng.choice(CODE_TASKS)}."
        else:  # retrieval
            name, para = rng.choice(passages)
            q = rng.choice(["What does the passage say {n} is used for?", "According to the passage, what does {n} do?",
                            "List the facts the passage gives about {n}."]).format(n=name)
            text = f"Read the passage and answer the question.\n\nPassage: {para}\n\nQuestion: {q}"
        if text not in seen:
            seen.add(text)
            out.append((kind, text))
    return out


def question_requests(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts asking the model to write a question itself (its answers become ``self`` prompts)."""
    rng = random.Random(seed + 1)
    subjects = CONCEPTS + [t for t in TOPICS] + [f"how to {a}" for a in ADVICE]
    return [rng.choice(["Write one question a curious student might ask about {s}. Reply with the question only.",
                        "Ask me one interesting question about {s}. Reply with the question only.",
                        "Write a short task someone could give an assistant about {s}. Reply with the task only."]
                       ).format(s=rng.choice(subjects)) for _ in range(n)]
