"""speculum's server as Ray Serve replicas under load: one replica against several, same load.

For each replica count R (``--replicas 1,2``) it starts ``speculum serve --replicas R`` on a free
loopback port (its own process group), waits for ``/health``, runs

    python -m speculum bench --workload serving --url http://127.0.0.1:PORT/v1 --concurrency C ...

then reads Ray Serve's request counter per replica from the metrics port the server prints
(``ray_serve_deployment_request_counter_total{replica=...}``, chat requests only), stops the server
with SIGINT (as Ctrl-C) and checks that it exits. Writes ``results.json`` and ``results.md`` to
``--out``: per R, tokens per second, requests sent / answered / failed, and the requests each
replica served. Needs ``pip install -e '.[ray]'``. Example (from the repository root)::

    .venv/bin/python benchmarks/ray_replicas.py --replicas 1,2 --concurrency 16 --requests 48 \\
        --data ../shared/data/spec_bench/question_dev.jsonl --out docs/bench/ray
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COUNTER = re.compile(r'^ray_serve_deployment_request_counter_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$')


def free_port() -> int:
    """A free port P on 127.0.0.1 whose neighbour P + 1 (Ray's metrics port) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise SystemExit("no pair of free ports found")


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, log: Path) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"speculum serve exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"speculum serve not healthy after {timeout:.0f} s; log {log}")


def replica_counts(metrics_port: int) -> dict[str, int]:
    """Chat-completion requests per replica, from Ray Serve's metrics (they can lag a few seconds)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = COUNTER.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        if labels.get("route") == "/v1/chat/completions":
            counts[labels["replica"]] = counts.get(labels["replica"], 0) + int(float(m["value"]))
    return counts


def run_level(replicas: int, args, out: Path) -> dict:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"ray-serve-{replicas}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "speculum", "serve", "--replicas", str(replicas), "--port", str(port),
           "--dtype", args.dtype, "--method", args.method, "--no-access-log"]
    print("starting:", " ".join(cmd), f"(log {log})", flush=True)
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO)
    try:
        wait_healthy(proc, port, args.startup_timeout, log)
        level_out = out / f"replicas-{replicas}"
        bench = [sys.executable, "-m", "speculum", "bench", "--workload", "serving",
                 "--url", f"http://127.0.0.1:{port}/v1", "--model", "default",
                 "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                 "--max-tokens", str(args.max_tokens), "--label", f"{replicas} Ray Serve replica(s)",
                 "--out", str(level_out), *args.bench_args]
        subprocess.run(bench, check=True, cwd=REPO, stdin=subprocess.DEVNULL)
        time.sleep(args.metrics_wait)  # Ray exports its counters every few seconds
        counts = replica_counts(port + 1)
        result = json.loads((level_out / "results.json").read_text())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                print("warning: the server did not stop on SIGINT within 120 s (killed)", flush=True)
    row = result["rows"][-1]
    return {"replicas": replicas, "stopped_cleanly": proc.returncode == 0, "per_replica": counts,
            **{k: row[k] for k in ("concurrency", "requests", "errors", "tokens", "wall_s", "tok_s",
                                    "ttft_p50_s", "ttft_p99_s")}}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--replicas", default="1,2", help="replica counts to compare (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default: %(default)s)")
    p.add_argument("--requests", type=int, default=48, help="requests per run (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--method", default="auto")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--metrics-wait", type=float, default=12.0, help="seconds for Ray's metrics to catch up")
    p.add_argument("--out", default="bench-out/ray-replicas")
    args, args.bench_args = p.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_level(int(r), args, out) for r in args.replicas.split(",")]
    lines = [(f"{args.concurrency} clients, {args.requests} requests of at most {args.max_tokens} tokens, "
             f"{args.method}, {args.dtype}"), "",
             ("| replicas | tok/s | vs 1 replica | answered / sent | failed | requests per replica | "
             "TTFT p50 / p99 (s) | clean stop |"), "|---|---|---|---|---|---|---|---|"]
    base = next((r["tok_s"] for r in rows if r["replicas"] == 1), None)
    for r in rows:
        vs = f"{r['tok_s'] / base:.2f}x" if base else "-"
        per = ", ".join(str(v) for v in sorted(r["per_replica"].values(), reverse=True)) or "-"
        lines.append(f"| {r['replicas']} | {r['tok_s']:.1f} | {vs} | {r['requests'] - r['errors']} / {r['requests']} "
                     f"| {r['errors']} | {per} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{'yes' if r['stopped_cleanly'] else 'no'} |")
    text = "\n".join(lines) + "\n"
    (out / "results.json").write_text(json.dumps({"settings": {k: v for k, v in vars(args).items()}, "rows": rows},
                                                 indent=1))
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
