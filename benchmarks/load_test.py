"""Load test of ``speculum serve`` on loopback with the official ``openai`` client.

Starts the server as a subprocess (127.0.0.1 only), computes each prompt's greedy answer alone,
then runs ``--clients`` concurrent clients x ``--requests`` requests each, twice:

1. with the default queue (every request admitted): no errors allowed; p50/p99 latency, time to
   first token (streamed requests) and total generated tok/s are reported;
2. against a server started with ``--max-queue 4``: requests beyond the queue must get 429 or
   503 with an OpenAI-shaped error, and no request may be lost. In float32 (or with ``ar``) every
   admitted request must return exactly its solo answer (nothing corrupted).

Every other request streams. Run from the repository root (needs ``pip install openai``):

    python benchmarks/load_test.py --out docs/bench/load                     # bfloat16: speed
    python benchmarks/load_test.py --dtype float32 --out docs/bench/load     # float32: exactness
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

PROMPTS = [
    "Name three rivers in Europe.", "What is 12 times 12?", "Give a synonym for happy.",
    "Write a haiku about rain.", "What is the capital of Japan?", "List two prime numbers above 10.",
    "Translate 'good morning' to Spanish.", "Describe a cat in one sentence.", "What colour is the sky?",
    "Name a famous painter.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_queue: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "speculum.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--method", args.method, "--host", "127.0.0.1", "--port", str(port), "--max-queue", str(max_queue)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=5)
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()}")
        try:
            client.models.list()
            return proc, url
        except openai.APIConnectionError:
            time.sleep(0.5)
    raise SystemExit("server did not start")


def one_request(client, prompt: str, max_tokens: int, stream: bool) -> dict:
    t0 = time.perf_counter()
    msgs = [{"role": "user", "content": prompt}]
    try:
        if stream:
            text, ttft, usage = "", None, None
            for chunk in client.chat.completions.create(model=client.model_name, messages=msgs, temperature=0,
                                                        max_tokens=max_tokens, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - t0
                    text += chunk.choices[0].delta.content
                if chunk.usage:
                    usage = chunk.usage
            tokens = usage.completion_tokens
        else:
            r = client.chat.completions.create(model=client.model_name, messages=msgs, temperature=0,
                                               max_tokens=max_tokens)
            text, ttft, tokens = r.choices[0].message.content, None, r.usage.completion_tokens
        return {"ok": True, "prompt": prompt, "text": text, "tokens": tokens, "latency": time.perf_counter() - t0,
                "ttft": ttft}
    except openai.APIStatusError as e:
        body = e.response.json().get("error", {})
        return {"ok": False, "prompt": prompt, "status": e.status_code, "error": body,
                "shaped": set(body) == {"message", "type", "param", "code"}}


def run_load(client, clients: int, requests: int, max_tokens: int) -> tuple[list[dict], float]:
    def worker(c: int) -> list[dict]:
        return [one_request(client, PROMPTS[(c * requests + k) % len(PROMPTS)], max_tokens, stream=(k % 2 == 1))
                for k in range(requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(worker, range(clients)) for r in rs]
    return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=10, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="load-test")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report: dict = {"settings": vars(args)}

    proc, url = start_server(args, max_queue=args.clients * args.requests)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        client.model_name = args.model
        solo = {p: one_request(client, p, args.max_tokens, stream=False)["text"] for p in PROMPTS}
        results, wall = run_load(client, args.clients, args.requests, args.max_tokens)
        ok = [r for r in results if r["ok"]]
        lat = [r["latency"] for r in ok]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        report["open_queue"] = {
            "requests": len(results), "errors": len(results) - len(ok),
            "correct": sum(r["text"] == solo[r["prompt"]] for r in ok),
            "latency_p50_s": round(pct(lat, 0.5), 3), "latency_p99_s": round(pct(lat, 0.99), 3),
            "ttft_p50_s": round(pct(ttft, 0.5), 3) if ttft else None,
            "ttft_p99_s": round(pct(ttft, 0.99), 3) if ttft else None,
            "generated_tokens": sum(r["tokens"] for r in ok), "wall_s": round(wall, 2),
            "total_tok_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "mean_latency_s": round(statistics.mean(lat), 3),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    proc, url = start_server(args, max_queue=4)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        client.model_name = args.model
        results, wall = run_load(client, args.clients, args.requests, args.max_tokens)
        ok = [r for r in results if r["ok"]]
        refused = [r for r in results if not r["ok"]]
        report["queue_4"] = {
            "requests": len(results), "served": len(ok), "refused": len(refused),
            "refused_statuses": sorted({r["status"] for r in refused}),
            "refused_all_429_or_503_and_openai_shaped": all(r["status"] in (429, 503) and r["shaped"]
                                                             for r in refused),
            "served_correct": sum(r["text"] == solo[r["prompt"]] for r in ok),
            "lost": len(results) - len(ok) - len(refused),
            "example_refusal": refused[0]["error"] if refused else None, "wall_s": round(wall, 2),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"load_test_{args.dtype}_{args.method}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    a, b = report["open_queue"], report["queue_4"]
    # Identical answers are promised in float32. In bfloat16 a tree-drafting method may verify a
    # different tree shape than it did alone (its cross-request state has moved on), and bfloat16
    # rounding then differs: see docs/architecture.md ("Why bfloat16 outputs can differ from ar").
    exact = args.dtype == "float32" or args.method == "ar"
    good = (a["errors"] == 0 and b["refused"] > 0 and b["lost"] == 0
            and b["refused_all_429_or_503_and_openai_shaped"]
            and (not exact or (a["correct"] == a["requests"] and b["served_correct"] == b["served"])))
    print("PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
