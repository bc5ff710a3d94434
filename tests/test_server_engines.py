"""``serve --engines N``: the model in engine processes behind the HTTP process (SmolLM2, float32).

Greedy outputs through two engine processes equal the engine run directly, token for token, for
concurrent requests spread over both; constrained output (the constraint travels to the engine as
its spec); a client that disconnects mid-stream frees its slot; and an engine that dies takes only
its own requests with it.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from conftest import chat, openai_client, serving

from speculum.cli import main as cli_main
from speculum.methods import build_method
from speculum.models import load_tokenizer_and_config
from speculum.prompts import encode_prompt
from speculum.server import ServerState
from speculum.server.engines import EngineConfig, EnginePool
from speculum.server.metrics import Metrics

pytestmark = pytest.mark.slow

PROMPTS = ["List three colours of the rainbow.", "Name two planets.", "Count from 1 to 6.",
           "What is the capital of Italy?", "Give one word that rhymes with cat.", "Say hello in French."]


@pytest.fixture(scope="module")
def server():
    tok, _ = load_tokenizer_and_config("default")
    pool = EnginePool(EngineConfig(dtype="float32", method="ngram", max_batch=2, weights="float"), 2, Metrics(),
                      max_queue=16)
    with serving(ServerState.over_engines(pool, tok, "smollm2", "ngram")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


_chat = chat


def _engine_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("speculum:engine_requests_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def test_concurrent_requests_equal_the_engine_alone_and_use_both_engines(server, client, smollm2_f32):
    model, tok = smollm2_f32
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        outs = list(ex.map(lambda p: _chat(client, p, max_tokens=20), PROMPTS))
    for prompt, out in zip(PROMPTS, outs):
        alone = build_method("ar", model, tok).run(encode_prompt(tok, prompt), 20)
        assert out.choices[0].message.content == alone.text, prompt
        assert out.usage.completion_tokens == alone.new_tokens
        assert out.model_extra["speculum"]["method"] == "ngram"
    counts = _engine_counts(server[1])
    assert set(counts) == {"0", "1"} and min(counts.values()) >= 1, counts


def test_streaming_and_a_json_schema_through_an_engine(client):
    whole = client.completions.create(model="smollm2", prompt="The three primary colours are", max_tokens=16,
                                      temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt="The three primary colours are", max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = _chat(client, "Invent a person as JSON.", max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_n_choices_run_on_one_engine_from_one_prefill(server, client):
    """``n=2``: the second choice goes to the engine of the first and copies its prompt's entries."""
    def computed() -> float:
        line = next(x for x in httpx.get(server[1] + "/metrics").text.splitlines()
                    if x.startswith("speculum:prompt_tokens_computed_total "))
        return float(line.split()[-1])

    before = computed()
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "Describe a cat in a few words."}],
          "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2}
    out = client.chat.completions.create(**kw)
    assert computed() - before == out.usage.prompt_tokens + 1  # the prompt once, then one root token
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == \
        [c.message.content for c in out.choices]


def test_a_kv_policy_request_through_an_engine(client, smollm2_f32):
    from speculum.kv import make_policy

    model, tok = smollm2_f32
    prompt = "Colours: red, green, blue, cyan, magenta, yellow, black, white. " * 6 + "Which colour is first?"
    out = _chat(client, prompt, max_tokens=12,
                extra_body={"speculum": {"method": "ar", "kv_policy": "streaming", "kv_budget": 40}})
    alone = build_method("ar", model, tok, kv_policy=make_policy("streaming", "40")).run(encode_prompt(tok, prompt), 12)
    assert out.choices[0].message.content == alone.text


def test_a_disconnected_stream_frees_its_slot(server, client):
    url = server[1]
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                              "stream": True, "temperature": 0}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    # both engines' slots serve new requests at once (max_batch 2 each: 4 in parallel)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: _chat(client, p, max_tokens=8), PROMPTS[:4]))
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)
    assert "speculum:request_cancelled_total 1.0" in httpx.get(url + "/metrics").text


def test_a_dead_engine_takes_only_its_own_requests(server, client):
    state = server[0]
    state.worker.engines[1].process.kill()
    state.worker.engines[1].process.join(timeout=10)
    for _ in range(100):  # its reader sees the pipe close
        if not state.worker.engines[1].alive:
            break
        time.sleep(0.05)
    for prompt in PROMPTS[:3]:  # all go to the engine left
        assert _chat(client, prompt, max_tokens=6).choices[0].message.content
    assert not state.worker.engines[1].alive


def test_engines_option_is_checked(capsys):
    assert cli_main(["serve", "--engines", "0"]) == 2
    assert "--engines must be in 1..64" in capsys.readouterr().err
