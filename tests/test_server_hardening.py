"""The server against hostile and careless clients, live on loopback (raw HTTP and the ``openai``
client): limits with 4xx answers while ``/health`` stays responsive, JSON only, the Host check,
API keys, CORS, tenant isolation of what drafters learn, queue slots freed by cancelled requests,
``Retry-After`` and the access log.
"""

import json
import logging
import socket
import statistics
import threading
import time

import httpx
import openai
import pytest
from conftest import serve_in_thread

from speculum.runners import runner_for
from speculum.runners.invariance import measure_floors
from speculum.server import ServerState, create_app
from speculum.server.guard import GuardSettings
from speculum.server.limits import RequestLimits, json_depth

pytestmark = pytest.mark.slow

KEYS = ("key-alpha", "key-beta")
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(smollm2_f32):
    """A server as ``speculum serve --api-key key-alpha --api-key key-beta --allowed-origins
    https://app.example --max-queue 1 --max-batch 1 --max-prompt-tokens 1000 --max-request-bytes 1048576`` would
    start it."""
    model, tok = smollm2_f32
    state = ServerState(model, tok, "smollm2", method="ngram", max_queue=1, max_batch=1,
                        limits=RequestLimits(compile_timeout_s=10.0, max_prompt_tokens=1000))
    guard = GuardSettings(api_keys=KEYS, allowed_hosts=GuardSettings.hosts_for("127.0.0.1"), max_body_bytes=1 << 20)
    srv, thread, port = serve_in_thread(create_app(state, guard, (ORIGIN,)))
    yield state, f"http://127.0.0.1:{port}", port
    srv.should_exit = True
    thread.join(timeout=10)
    state.close()


def _auth(key=KEYS[0]):
    return {"Authorization": f"Bearer {key}"}


def _client(server, key=KEYS[0]):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=key, max_retries=0, timeout=120)


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert "\n" not in body["message"]
    if code is not None:
        assert body["code"] == code, body
    return body


def _health_latencies(url, seconds_until, probes=8):
    """``/health`` round trips (s) measured while ``seconds_until()`` is true (at least ``probes``)."""
    out = []
    with httpx.Client(timeout=10) as c:
        while seconds_until() or len(out) < probes:
            t = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.02)
    return out


def _assert_responsive(latencies):
    """``/health`` answered within 100 ms (90th percentile: this shares 2 cores with the suite's other
    worker and with the client threads; before the fix one probe waited 4-13 s)."""
    ordered = sorted(latencies)
    assert ordered[int(0.9 * (len(ordered) - 1))] < 0.1 and ordered[-1] < 0.5, latencies


def test_json_depth_counts_nesting():
    assert json_depth(1) == 1 and json_depth([1]) == 2 and json_depth({"a": [{"b": []}]}) == 4
    deep = []
    for _ in range(100000):  # iterative: no RecursionError
        deep = [deep]
    assert json_depth(deep) == 100001


def test_huge_body_is_413_before_it_is_read_and_health_stays_fast(server):
    _, url, port = server
    with socket.create_connection(("127.0.0.1", port)) as s:  # declares 20 MB, sends 1 KB of it
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer key-alpha\r\nContent-Length: 20000000\r\n\r\n" + b" " * 1024)
        s.settimeout(10)
        head = b""
        while b"request_too_large" not in head:  # the body may come in a later packet than the headers
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    head = head.decode("latin-1")
    assert head.startswith("HTTP/1.1 413") and "request_too_large" in head

    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"x" * (20 << 20) + b'"}]}'
    done = threading.Event()
    outcome = []

    def upload():
        try:
            outcome.append(httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                                      headers={**_auth(), "Content-Type": "application/json"}).status_code)
        except httpx.HTTPError as e:  # the server may close the connection before the upload ends
            outcome.append(type(e).__name__)
        done.set()

    threading.Thread(target=upload).start()
    latencies = _health_latencies(url, lambda: not done.is_set())
    done.wait(60)
    assert outcome and outcome[0] in (413, "WriteError", "RemoteProtocolError", "ReadError"), outcome
    _assert_responsive(latencies)
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (b"[" + b" " * 65536 for _ in range(40))
    r = httpx.post(url + "/v1/completions", content=chunks, timeout=60,
                   headers={**_auth(), "Content-Type": "application/json"})
    _error(r, 413, "request_too_large")


def test_huge_grammars_are_refused_and_health_stays_fast(server):
    state, url, _ = server
    words = "|".join(f"word{i}" for i in range(200_000))  # 1.6 MB: over the 1 MiB body limit
    _error(httpx.post(url + "/v1/chat/completions", json={**CHAT, "speculum": {"regex": words}}, headers=_auth(),
                      timeout=60), 413, "request_too_large")
    words = "|".join(f"w{i}" for i in range(60_000))  # 470 KB: under the body limit, over the grammar limit
    result = []
    t = threading.Thread(target=lambda: result.append(httpx.post(
        url + "/v1/chat/completions", json={**CHAT, "speculum": {"regex": words}}, headers=_auth(), timeout=60)))
    t.start()
    latencies = _health_latencies(url, t.is_alive)
    t.join()
    body = _error(result[0], 400, "grammar_too_large")
    assert body["param"] == "speculum.regex" and "--max-grammar-bytes" in body["message"]
    _assert_responsive(latencies)
    _error(httpx.post(url + "/v1/chat/completions", json={**CHAT, "speculum": {"choice": [f"c{i}" for i in range(50_000)]}},
                      headers=_auth(), timeout=60), 400, "grammar_too_large")
    # under the size limits but slow to compile: a timeout, answered as a 400
    old = state.limits
    state.limits = RequestLimits(compile_timeout_s=0.001)
    try:
        rx = "|".join(f"v{i}x" for i in range(6000))
        _error(httpx.post(url + "/v1/chat/completions", json={**CHAT, "speculum": {"regex": rx}}, headers=_auth(),
                          timeout=60), 400, "grammar_too_large")
    finally:
        state.limits = old


def test_a_regex_beyond_llguidance_limits_is_a_400(server):
    url = server[1] + "/v1/chat/completions"
    r = httpx.post(url, json={**CHAT, "max_tokens": 8, "speculum": {"regex": "a{1000000}"}}, headers=_auth(),
                   timeout=120)
    assert r.status_code in (200, 400), r.text  # refused, or cut at max_tokens: never a 500
    if r.status_code == 200:
        assert set(r.json()["choices"][0]["message"]["content"]) <= {"a"}
    assert httpx.post(url, json=CHAT, headers=_auth(), timeout=60).status_code == 200


def test_deep_nesting_is_400_and_the_connection_survives(server):
    url = server[1] + "/v1/chat/completions"
    with httpx.Client(timeout=60, headers={**_auth(), "Content-Type": "application/json"}) as c:
        deep = "[" * 10_000 + "]" * 10_000
        body = json.dumps(CHAT)[:-1] + ', "extra": ' + deep + "}"
        _error(c.post(url, content=body), 400, "nesting_too_deep")
        schema = {"type": "string"}
        for _ in range(200):
            schema = {"type": "object", "properties": {"a": schema}}
        fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
        _error(c.post(url, content=json.dumps({**CHAT, "response_format": fmt})), 400, "nesting_too_deep")
        assert c.post(url, content=json.dumps(CHAT)).status_code == 200  # same keep-alive connection


def test_prompt_token_limit(server):
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 1200}]}
    body = _error(httpx.post(server[1] + "/v1/chat/completions", json=long, headers=_auth(), timeout=60),
                  400, "prompt_too_long")
    assert "--max-prompt-tokens" in body["message"] and body["param"] == "messages"
    short = {**CHAT, "messages": [{"role": "user", "content": "word " * 900}]}
    assert httpx.post(server[1] + "/v1/chat/completions", json=short, headers=_auth(), timeout=120).status_code == 200


def test_json_only(server):
    url = server[1] + "/v1/chat/completions"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**_auth(), **({"Content-Type": ctype} if ctype else {})}
        _error(httpx.post(url, content=json.dumps(CHAT), headers=headers, timeout=60), 415, "unsupported_media_type")
    _error(httpx.post(url, content=b"{not json", headers={**_auth(), "Content-Type": "application/json"},
                      timeout=60), 400, "invalid_json")


def test_host_header_is_checked(server):
    _, url, port = server
    _error(httpx.get(url + "/health", headers={"Host": "evil.example"}), 403, "host_not_allowed")
    _error(httpx.post(url + "/v1/chat/completions", json=CHAT, headers={**_auth(), "Host": f"evil.example:{port}"},
                      timeout=60), 403, "host_not_allowed")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200
    assert GuardSettings.hosts_for("0.0.0.0") is None  # a wildcard bind cannot know its names
    assert "api.example" in GuardSettings.hosts_for("0.0.0.0", ("api.example",))


def test_api_key_is_required_on_v1(server):
    url = server[1]
    assert httpx.get(url + "/health").status_code == 200  # open: liveness probes carry no key
    _error(httpx.get(url + "/v1/models"), 401, "invalid_api_key")
    _error(httpx.get(url + "/v1/models", headers=_auth("wrong")), 401, "invalid_api_key")
    _error(httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    for key in KEYS:
        assert [m.id for m in _client(server, key).models.list().data] == ["smollm2"]


def test_cors_only_for_allowed_origins(server):
    url = server[1] + "/v1/chat/completions"
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(url, headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(url, headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers
    r = httpx.post(url, json=CHAT, headers={**_auth(), "Origin": "https://evil.example"}, timeout=60)
    assert "access-control-allow-origin" not in r.headers


def test_client_mistakes_are_4xx(server):
    url = server[1] + "/v1"
    post = lambda path, body: httpx.post(url + path, json=body, headers=_auth(), timeout=60)
    assert _error(post("/chat/completions", {**CHAT, "seed": 2 ** 64}), 400)["param"] == "seed"
    assert _error(post("/chat/completions", {**CHAT, "seed": -(2 ** 63) - 1}), 400)["param"] == "seed"
    assert post("/chat/completions", {**CHAT, "seed": 2 ** 64 - 1}).status_code == 200
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0),
                         ("logit_bias", {"5": 3}), ("best_of", 2), ("top_logprobs", 2), ("tool_choice", "auto")]:
        assert _error(post("/chat/completions", {**CHAT, field: value}), 400)["param"] == field, field
    assert _error(post("/completions", {"model": "smollm2", "prompt": "a", "suffix": "b"}), 400)["param"] == "suffix"
    assert _error(post("/chat/completions", {**CHAT, "speculum": {"methd": "ngram"}}), 400)["param"] \
        .startswith("speculum")
    assert _error(post("/chat/completions", {**CHAT, "stop": ["x" * 1000]}), 400)["param"] == "stop"
    assert post("/chat/completions", {**CHAT, "presence_penalty": 0, "user": "u1", "metadata": {}}).status_code == 200
    assert post("/chat/completions", {**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                                      "repetition_penalty": 1.2}).status_code == 200


def _queue_is_free(state, timeout=5.0):
    deadline = time.time() + timeout
    while state.worker._waiting and time.time() < deadline:
        time.sleep(0.05)
    return state.worker._waiting == 0


def test_queue_full_has_retry_after_and_a_gone_client_frees_its_slot(server):
    state, url, _ = server
    long = {**CHAT, "max_tokens": 2000, "stream": True,
            "speculum": {"regex": "[a-z ]{5000}"}}  # no end-of-sequence before max_tokens
    with httpx.Client(timeout=120, headers=_auth()) as running, \
            running.stream("POST", url + "/v1/chat/completions", json=long) as stream:
        lines = stream.iter_lines()
        while '"delta": {"content"' not in next(lines):  # the role chunk may come before the worker starts
            pass  # generating once content arrives: the worker is busy, the queue empty
        # a client that gives up while queued
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, headers=_auth(), timeout=1.0)
        assert _queue_is_free(state), "the gone client still holds the queue slot"
        queued = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json=CHAT,
                                                            headers=_auth(), timeout=120))
        queued.start()  # takes the one slot
        deadline = time.time() + 10
        while state.worker._waiting == 0 and time.time() < deadline:
            time.sleep(0.02)
        busy = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=_auth(), timeout=60)
        _error(busy, 429, "queue_full")
        assert int(busy.headers["Retry-After"]) >= 1
    queued.join(timeout=120)


def test_access_log_line_per_request(server, caplog):
    with caplog.at_level(logging.INFO, logger="speculum.access"):
        httpx.post(server[1] + "/v1/chat/completions", json=CHAT, headers=_auth(), timeout=60)
        httpx.get(server[1] + "/v1/models")
    lines = [r.getMessage() for r in caplog.records if r.name == "speculum.access"]
    assert any('"POST /v1/chat/completions" 200 tokens=' in x and "tokens=-" not in x for x in lines), lines
    assert any('"GET /v1/models" 401' in x for x in lines), lines


def test_drafter_state_is_per_tenant(server):
    """What ``suffix`` learnt from one tenant's request does not speed up another tenant's."""
    body = {**CHAT, "messages": [{"role": "user", "content": "Write two sentences about the sea."}],
            "max_tokens": 40, "speculum": {"method": "suffix"}}
    ask = lambda key, salt=None: httpx.post(
        server[1] + "/v1/chat/completions", json={**body, **({"cache_salt": salt} if salt else {})},
        headers=_auth(key), timeout=600).json()  # the first builds suffix (and may calibrate)
    first = ask(KEYS[0], "s1")
    again = ask(KEYS[0], "s1")
    other_salt = ask(KEYS[0], "s2")
    other_key = ask(KEYS[1], "s1")
    text = first["choices"][0]["message"]["content"]
    assert all(r["choices"][0]["message"]["content"] == text for r in (again, other_salt, other_key))
    assert again["speculum"]["mean_accepted"] > first["speculum"]["mean_accepted"] + 1  # learnt within a tenant
    for r in (other_salt, other_key):  # nothing learnt across tenants: as fresh as the first
        assert r["speculum"]["mean_accepted"] == first["speculum"]["mean_accepted"]
        assert r["speculum"]["forwards"] == first["speculum"]["forwards"]


def test_health_latency_is_low_at_rest(server):
    latencies = _health_latencies(server[1], lambda: False, probes=10)
    assert statistics.median(latencies) < 0.05, latencies


@pytest.mark.parametrize("sampled", [False, True], ids=["temperature0", "seeded"])
def test_repeats_give_one_output_whatever_the_drafter_learnt(server, sampled):
    """10 repeats through ``auto`` in float32, other requests in between that change what the suffix
    cache and the bandit hold: one output, and ``ar``'s (whole trees verified if this machine's float32
    kernels have no row floors; bfloat16: below)."""
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 1234} if sampled else {"temperature": 0}
    body = {**CHAT, **params, "max_tokens": 48,
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]}
    other = {**CHAT, "max_tokens": 24, "speculum": {"method": "auto"}}
    post = lambda b: httpx.post(server[1] + "/v1/chat/completions", json=b, headers=_auth(), timeout=600).json()
    texts = set()
    for i in range(10):
        texts.add(post({**body, "speculum": {"method": "auto"}})["choices"][0]["message"]["content"])
        post({**other, "messages": [{"role": "user", "content": f"Tell me fact number {i} about lighthouses."}]})
    assert len(texts) == 1, texts
    assert post({**body, "speculum": {"method": "ar"}})["choices"][0]["message"]["content"] in texts


@pytest.fixture(scope="module")
def bf16_server():
    """``speculum serve --dtype bfloat16`` (the reproducible mode is on by default, or forced with
    every step padded where this machine's kernels have no row floors)."""
    import speculum

    model, tok = speculum.load("default", dtype="bfloat16", weights="float")
    floors = measure_floors(runner_for(model).decoder)  # what ServerState measures too
    state = ServerState(model, tok, "smollm2", method="auto",
                        deterministic=None if floors is not None and floors.cheap else True)
    assert state.deterministic and state.chains_only
    srv, thread, port = serve_in_thread(create_app(state))
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)
    state.close()


@pytest.mark.parametrize("sampled", [False, True], ids=["temperature0", "seeded"])
def test_bfloat16_repeats_by_default(bf16_server, sampled):
    """10 repeats through ``auto`` in bfloat16 with other requests in between (which change what the
    suffix cache, the recycling table and the bandit hold, and so the drafts): one output, ``ar``'s."""
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 77} if sampled else {"temperature": 0}
    body = {**CHAT, **params, "max_tokens": 48,
            "messages": [{"role": "user", "content": "Explain how a lighthouse works, in three sentences."}]}
    post = lambda b: httpx.post(bf16_server + "/v1/chat/completions", json=b, timeout=600).json()
    texts = set()
    for i in range(10):
        texts.add(post(body)["choices"][0]["message"]["content"])
        post({**CHAT, "max_tokens": 8,
              "messages": [{"role": "user", "content": f"List {i + 2} colours of the sea, then {i + 2} fish."}]})
    assert len(texts) == 1, texts
    assert post({**body, "speculum": {"method": "ar"}})["choices"][0]["message"]["content"] in texts
