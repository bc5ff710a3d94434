"""The OpenAI-compatible server, live on loopback, driven by the official ``openai`` client.

SmolLM2 in float32 (greedy outputs are compared token for token with the engine run directly).
Covers: models / health / metrics, completions and chat (streamed and not), JSON outputs validated
with ``jsonschema``, the per-request drafter, concurrent requests, the bounded queue (429), a
client that disconnects mid-stream, and every bad input the issue lists (OpenAI-shaped 4xx).
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import chat, openai_client, serving

from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.sampling import SamplingParams
from speculum.server import ServerState

pytestmark = pytest.mark.slow

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def server(smollm2_f32):
    model, tok = smollm2_f32
    with serving(ServerState(model, tok, "smollm2", method="ngram", max_queue=16, max_batch=4)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


_chat = chat


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(server[1] + "/health").json()["status"] == "ok"
    text = httpx.get(server[1] + "/metrics").text
    for name in ("speculum:request_success_total", "speculum:prompt_tokens_total",
                 "speculum:generation_tokens_total", "speculum:time_to_first_token_seconds_bucket",
                 "speculum:time_per_output_token_seconds_bucket", "speculum:num_requests_waiting"):
        assert name in text or name.replace("_total", "") in text, name


def test_chat_equals_the_engine_alone(server, client):
    state = server[0]
    prompt = "List three colours of the rainbow."
    out = _chat(client, prompt, max_tokens=24)
    ids = encode_prompt(state.tokenizer, prompt)
    alone = build_method("ar", state.model, state.tokenizer, runner=state.runner).run(ids, 24)
    assert out.choices[0].message.content == alone.text
    assert out.usage.completion_tokens == alone.new_tokens and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].finish_reason == ("length" if alone.finish_reason == "length" else "stop")
    assert out.model_extra["speculum"]["method"] == "ngram"


def test_streaming_matches_non_streaming(client):
    whole = client.completions.create(model="smollm2", prompt="The three primary colours are", max_tokens=20,
                                      temperature=0)
    chunks = list(client.completions.create(model="smollm2", prompt="The three primary colours are",
                                            max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    chat = list(_chat(client, "Say hello in French.", max_tokens=12, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat)
    assert streamed == _chat(client, "Say hello in French.", max_tokens=12).choices[0].message.content


def test_stop_strings_streamed_and_not(client):
    kw = {"model": "smollm2", "prompt": "Count: one, two, three, four,", "max_tokens": 24, "temperature": 0, "stop": [" six"]}
    whole = client.completions.create(**kw)
    assert " six" not in whole.choices[0].text and whole.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole.choices[0].text


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix"])
def test_json_schema_outputs_are_valid(client, method):
    out = _chat(client, "Invent a person who lives in Europe. Reply in JSON.", max_tokens=80,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
                extra_body={"speculum": {"method": method}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert out.model_extra["speculum"]["method"] == method
    obj = _chat(client, "Describe a cat as JSON.", max_tokens=60, response_format={"type": "json_object"},
                extra_body={"speculum": {"method": method}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = _chat(client, "Is fire hot?", max_tokens=8, extra_body={"speculum": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")


def test_budget_closer_keeps_a_cut_output_valid(client):
    """``speculum.close_reserve``: an output the budget cuts still ends as valid JSON (finish "length")."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    prompt = "Invent a person who lives in Europe. Reply in JSON."
    cut = _chat(client, prompt, max_tokens=20, response_format=fmt)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)
    closed = _chat(client, prompt, max_tokens=20, response_format=fmt, extra_body={"speculum": {"close_reserve": 20}})
    assert closed.choices[0].finish_reason == "length"
    jsonschema.validate(json.loads(closed.choices[0].message.content), PERSON)


def test_sampling_is_seeded(client):
    a = _chat(client, "Write a word.", max_tokens=8, seed=7).choices[0].message.content
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a word."}], "max_tokens": 8,
              "temperature": 0.9, "top_p": 0.9, "seed": 11}
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content
    assert a


def test_concurrent_requests_each_equal_their_solo_result(client):
    prompts = [f"Name {k} fruits." for k in range(2, 8)]
    solo = [_chat(client, p, max_tokens=16).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _chat(client, p, max_tokens=16).choices[0].message.content, prompts))
    assert together == solo


def test_full_queue_answers_429_and_loses_nothing(server, client):
    state = server[0]
    state.worker.max_queue = 1
    try:
        def call(i):
            try:
                return _chat(client, f"Write the number {i} in words.", max_tokens=12).choices[0].message.content
            except openai.RateLimitError as e:
                assert e.status_code == 429
                body = e.response.json()["error"]
                assert body["code"] == "queue_full" and "busy" in body["message"]
                return None
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(call, range(6)))
    finally:
        state.worker.max_queue = 16
    served = [i for i, g in enumerate(got) if g is not None]
    assert 0 < len(served) < 6
    for i in served:  # the admitted ones are complete and uncorrupted
        assert got[i] == _chat(client, f"Write the number {i} in words.", max_tokens=12).choices[0].message.content


def test_disconnect_cancels_generation(server, client):
    state = server[0]
    before = state.metrics.cancelled._value.get()
    stream = client.completions.create(model="smollm2", prompt="Count to 1000: 1, 2, 3, 4,",
                                       max_tokens=2000, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.time() + 30
    while state.metrics.cancelled._value.get() == before and time.time() < deadline:
        time.sleep(0.1)
    assert state.metrics.cancelled._value.get() == before + 1
    t0 = time.time()  # the worker is free again at once
    _chat(client, "Hi", max_tokens=4)
    assert time.time() - t0 < 20


def test_disconnect_cancels_non_streamed_generation(server):
    state = server[0]
    before = state.metrics.cancelled._value.get()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server[1] + "/v1/completions", timeout=3,
                   json={"model": "smollm2", "prompt": "Count to 1000: 1, 2, 3, 4,", "max_tokens": 2000,
                         "temperature": 0})
    deadline = time.time() + 30
    while state.metrics.cancelled._value.get() == before and time.time() < deadline:
        time.sleep(0.1)
    assert state.metrics.cancelled._value.get() == before + 1


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client):
    url = server[1] + "/v1"
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    post = lambda path, body: httpx.post(url + path, json=body, timeout=60)
    assert _error(httpx.post(url + "/chat/completions", content=b"{not json", timeout=60,
                             headers={"Content-Type": "application/json"}), 400)["code"] == "invalid_json"
    assert _error(post("/chat/completions", {**chat, "max_tokens": "many"}), 400)["param"] == "max_tokens"
    assert _error(post("/chat/completions", {**chat, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _error(post("/chat/completions", {**chat, "messages": "hi"}), 400)["param"] == "messages"
    assert _error(post("/chat/completions", {**chat, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert _error(post("/chat/completions", {**chat, "max_tokens": -5}), 400)["param"] == "max_tokens"
    assert _error(post("/chat/completions", {**chat, "temperature": -1}), 400)["param"] == "temperature"
    assert _error(post("/chat/completions", {**chat, "n": 17}), 400)["param"] == "n"  # over --max-n
    assert _error(post("/chat/completions", {**chat, "n": 0}), 400)["param"] == "n"
    assert _error(post("/completions", {"model": "smollm2", "prompt": "a", "n": 3, "best_of": 2}),
                  400)["param"] == "best_of"
    assert _error(post("/completions", {"model": "smollm2", "prompt": "a", "best_of": 3, "stream": True}),
                  400)["param"] == "best_of"
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    assert _error(post("/chat/completions", {**chat, "tools": [bad_tool]}), 400)["param"] == "tools"
    assert _error(post("/chat/completions", {**chat, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "fly"}}}), 400)["param"] == "tool_choice"
    assert _error(post("/chat/completions", {**chat, "tool_choice": "required"}), 400)["param"] == "tool_choice"
    assert _error(post("/chat/completions", {**chat, "tools": TOOLS + TOOLS[:1]}), 400)["param"] == "tools"
    assert _error(post("/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "a b"}}]}),
                  400)["param"].startswith("tools")
    assert _error(post("/chat/completions", {**chat, "tools": TOOLS, "response_format": {"type": "json_object"}}),
                  400)["param"] == "tools"
    assert _error(post("/completions", {"model": "smollm2", "prompt": [5] * 9000}), 400)["code"] == \
        "context_length_exceeded"
    assert _error(post("/completions", {"model": "smollm2", "prompt": "hi", "max_tokens": 9000}), 400)["code"] == \
        "context_length_exceeded"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    assert "schema" in _error(post("/chat/completions", {**chat, "response_format": bad_schema}), 400)["message"]
    assert _error(post("/chat/completions", {**chat, "response_format": {"type": "yaml"}}), 400)["param"] \
        .startswith("response_format")
    assert _error(post("/chat/completions", {**chat, "speculum": {"method": "magic"}}), 400)["param"] == \
        "speculum.method"
    assert "close_reserve" in _error(post("/chat/completions", {**chat, "speculum": {"close_reserve": 8}}),
                                     400)["message"]
    assert _error(post("/chat/completions", {**chat, "speculum": {"kv_policy": "lru"}}), 400)["param"] == \
        "speculum.kv_policy"
    assert _error(post("/chat/completions", {**chat, "speculum": {"kv_policy": "snapkv", "kv_budget": "lots"}}),
                  400)["param"] == "speculum.kv_policy"
    assert _error(post("/chat/completions", {**chat, "speculum": {"kv_budget": 64}}), 400)["param"] == \
        "speculum.kv_budget"
    assert _error(post("/chat/completions", {**chat, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    assert _error(httpx.get(url + "/nope"), 404)["code"] == "not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert _chat(client, "Still there?", max_tokens=4).choices[0].message.content  # still serving
    assert "speculum:request_rejected_total" in httpx.get(server[1] + "/metrics").text


def test_logprobs_chat_and_completions(server, client):
    """``logprobs``: chat's per-token entries and completions' lists, equal to the engine's own run with
    logprobs (the same verification forwards' numbers); streamed, the chunks carry the same entries."""
    state = server[0]
    prompt = "Name two planets."
    out = _chat(client, prompt, max_tokens=12, logprobs=True, top_logprobs=2)
    ids = encode_prompt(state.tokenizer, prompt)
    alone = build_method("ar", state.model, state.tokenizer, runner=state.runner).run(
        ids, 12, SamplingParams(logprobs=2))
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == alone.new_tokens
    for entry, want in zip(content, alone.logprobs):
        assert entry.token == state.tokenizer.decode([want.token])
        assert abs(entry.logprob - want.logprob) < 1e-4 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    done = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=6, temperature=0, logprobs=1)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(alts) == 1 and max(alts.values()) >= p - 1e-6 for alts, p in zip(lp.top_logprobs, lp.token_logprobs))
    for method in ("ar", "suffix_merged", "recycling_scored", "mix", "eagle", "medusa"):  # every drafter family
        other = _chat(client, prompt, max_tokens=12, logprobs=True, top_logprobs=2,
                      extra_body={"speculum": {"method": method}}).choices[0].logprobs.content
        assert [e.token for e in other] == [e.token for e in content], method
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(other, alone.logprobs)), method
    streamed = [c for c in _chat(client, prompt, max_tokens=12, logprobs=True, top_logprobs=2, stream=True)
                if c.choices and c.choices[0].logprobs]
    entries = [e for c in streamed for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(entries, content))


def _metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_n_choices_share_the_prefill_and_repeat_with_a_seed(server, client):
    """``n=4``: four choices decoded as one batch from one prefill of the prompt (the others copy
    its entries: ``/metrics`` counts the prompt computed once), choice ``i`` sampled with
    ``seed + i`` (what the engine alone gives with that seed), the same again for the same request,
    and streamed the same; completions' ``best_of`` returns the ``n`` most likely."""
    state, url = server
    prompt = "Write one short sentence about the sea and the wind."
    ids = encode_prompt(state.tokenizer, prompt)
    computed = _metric(url, "speculum:prompt_tokens_computed_total")
    kw = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": 10,
          "temperature": 1.0, "seed": 7, "n": 4}
    out = client.chat.completions.create(**kw)
    assert _metric(url, "speculum:prompt_tokens_computed_total") - computed == len(ids) + 3  # + each root
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1 and out.usage.prompt_tokens == len(ids)
    alone = build_method("ngram", state.model, state.tokenizer, runner=state.runner).run(
        ids, 10, SamplingParams(temperature=1.0), seed=9)
    assert texts[2] == alone.text
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == texts
    streamed = {}
    for c in client.chat.completions.create(**kw, stream=True):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts
    best = client.completions.create(model="smollm2", prompt="The sea is", max_tokens=6, temperature=1.0, seed=3,
                                     n=2, best_of=4)
    every = client.completions.create(model="smollm2", prompt="The sea is", max_tokens=6, temperature=1.0, seed=3,
                                      n=4, logprobs=0)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None


def _tool(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


TOOLS = [_tool("get_weather", {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}}, ["city"]),
         _tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
         _tool("search_web", {"query": {"type": "string", "maxLength": 40}}, ["query"]),
         _tool("set_timer", {"minutes": {"type": "number", "minimum": 0, "maximum": 600}}, ["minutes"]),
         _tool("send_email", {"to": {"type": "string", "maxLength": 30}, "subject": {"type": "string", "maxLength": 30}},
               ["to", "subject"])]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What is the weather in Oslo?", "Add 17 and 25.", "Search the web for speculative decoding.",
        "Set a timer for 10 minutes.", "Email bob@example.com that the meeting moved.", "Is it raining in Rome?",
        "What is 3 plus 4?", "Find recipes for pancakes online.", "Remind me in 5 minutes.", "Write to ann@x.org."]


def test_tool_calls_parse_against_their_schemas(server, client):
    """``tools`` with ``tool_choice`` ``required``, streamed: 30 requests (3 at a time) with 5 tools,
    every call's arguments parse and match its function's schema; a named choice calls that function,
    once without ``parallel_tool_calls``; an earlier call and its result are accepted as conversation;
    with ``auto`` the stream carries what the whole reply does."""
    def streamed(k: int) -> tuple[list, str]:
        calls, finish = [], None
        for c in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASKS[k % 10]}],
                                                tools=TOOLS, tool_choice="required", temperature=0.7, seed=k,
                                                max_tokens=100, stream=True):
            for choice in c.choices:
                assert not choice.delta.content
                calls.extend(choice.delta.tool_calls or [])
                finish = choice.finish_reason or finish
        return calls, finish

    with ThreadPoolExecutor(3) as ex:
        replies = list(ex.map(streamed, range(30)))
    for made, finish in replies:
        # (a reply that calls again and again is closed validly by the budget closer: "length")
        assert made and finish in ("tool_calls", "length") and [c.index for c in made] == list(range(len(made)))
        for call in made:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    named = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASKS[0]}],
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                           parallel_tool_calls=False, temperature=0, max_tokens=160)
    message = named.choices[0].message
    assert message.content is None and named.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["add"] and message.tool_calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMAS["add"])
    follow_up = [{"role": "user", "content": ASKS[0]},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3, "unit": "C"}'}]
    answer = client.chat.completions.create(model="smollm2", messages=follow_up, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=12)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    for ask in ("Say hello to Ann.", ASKS[1]):  # auto: text or calls, the stream the same as the whole
        kw = {"model": "smollm2", "messages": [{"role": "user", "content": ask}], "tools": TOOLS,
              "tool_choice": "auto", "temperature": 0, "max_tokens": 48}
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == (whole.message.content or "")
        assert [t.function.arguments for c in chunks for t in c.delta.tool_calls or []] == \
            [t.function.arguments for t in whole.message.tool_calls or []]
        assert chunks[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_a_kv_policy_per_request_equals_the_engine_alone(server, client, method):
    """``speculum.kv_policy``: that request runs on the policy's runner, beside the others; its
    text is what the same method under the same policy gives alone."""
    from speculum.kv import make_policy

    state = server[0]
    prompt = ("Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape. " * 6
              + "Which fruit comes after cherry?")
    ids = encode_prompt(state.tokenizer, prompt)
    with ThreadPoolExecutor(2) as ex:  # a plain request in the same batch
        plain = ex.submit(_chat, client, "Name two rivers.", max_tokens=12)
        out = _chat(client, prompt, max_tokens=16, extra_body={"speculum": {"method": method, "kv_policy": "snapkv",
                                                                            "kv_budget": 48}})
        plain.result()
    alone = build_method(method, state.model, state.tokenizer, runner=state.runner,
                         kv_policy=make_policy("snapkv", "48")).run(ids, 16)
    assert out.choices[0].message.content == alone.text
    assert out.usage.prompt_tokens == len(ids) > 48


def test_spec_decode_metrics_per_method(server, client):
    _chat(client, "Repeat: alpha beta gamma delta alpha beta gamma delta", max_tokens=24,
          extra_body={"speculum": {"method": "ngram"}})
    text = httpx.get(server[1] + "/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("speculum:spec_decode_num_draft_tokens_total{")]
    assert any('method="ngram"' in x and float(x.split()[-1]) > 0 for x in lines)
    assert 'speculum:spec_decode_num_accepted_tokens_per_pos_total{method="ngram",position="1"}' in text


def test_serving_benchmark_drives_the_server(server, tmp_path):
    """``bench --workload serving``'s load generator against this server: every request answered,
    the shared system prompt's entries reused, and the table and plot written."""
    from speculum.bench.data import demo_prompts_path, load_prompts
    from speculum.bench.serving import run_serving, write_serving

    state, url = server
    hits = state.prefix_cache.hits
    run = run_serving(url + "/v1", "smollm2", load_prompts(demo_prompts_path()), [1, 3], requests=4,
                      max_tokens=8, system_tokens=300, prefix_requests=3, progress=False)
    assert [r["concurrency"] for r in run["rows"]] == [1, 3]
    assert all(r["errors"] == 0 and r["tokens"] > 0 and r["tok_s"] > 0 for r in run["rows"])
    assert run["shared_prefix"]["requests"] == 3 and run["shared_prefix"]["prompt_tokens"][0] > 300
    assert state.prefix_cache.hits >= hits + 2  # the later shared-prefix requests reused the first's entries
    assert state.metrics.prefix_hit_tokens._value.get() >= 2 * 300
    text, out = write_serving(tmp_path, "speculum ngram", run, {"settings": {}})
    assert "| speculum ngram | 3 | 4 |" in text
    assert (out / "serving.png").stat().st_size > 0 and (out / "results.json").exists()
