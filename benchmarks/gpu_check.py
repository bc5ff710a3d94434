"""Every GPU measurement of issue 44 in one run, written as one Markdown table (``gpu_check.md``).

Run through ``benchmarks/gpu_check.sh`` (which puts ``src/`` on the path and installs ``gguf`` from a
carried wheel where it is missing)::

    python benchmarks/gpu_check.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --data question_dev.jsonl --out DIR

Parts, most important first, each in its own process with its own time limit (a part that fails or
runs out of time is reported as such and the rest still run):

1. ``bf16``: ``speculum bench`` on the GGUF model (float weights, bfloat16, CUDA), ``--per-task 2
   --max-new-tokens 128``: ``ar``, ``ngram``, ``mix``, ``eagle``, ``auto``, interleaved after a warm-up,
   one process.
2. ``llama1b``: a random-weight Llama with TinyLlama-1.1B's shape, ``ar`` on the native runner (speed
   only): tokens per second over a few 128-token decodes after a warm-up.
3. ``f32``: ``speculum bench`` in float32 on the GPU, every method's output against ``ar``'s (lossless).
4. ``step``: where one ``ar`` step's time goes on the packaged model (bfloat16): the whole engine step,
   the graph replay alone (CUDA events) and the number of kernels in one eager forward.
5. ``hfc``: transformers' static cache + ``torch.compile`` (``hf_compiled``) against ``ar``, the same
   prompts, in a run of its own (its compilation can take minutes); the table scales it by ``ar``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BF16_METHODS = "ar,ngram,mix,eagle,auto"
# transformers' compiled path in a run of its own (its compilation can take minutes): its ratio to `ar`
# there, times `auto`'s to `ar` in the main run, is `auto`'s to it
HFC_METHODS = "hf_compiled,ar"
F32_METHODS = "ar,ngram,mix,eagle,medusa,auto"
# TinyLlama-1.1B's shape
LLAMA_1B = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
TARGETS = {  # the acceptance points
    "auto_vs_ar": 1.3, "eagle_vs_ar": 1.1, "ar_tok_s": 800.0, "auto_vs_hf_compiled": 4.0, "llama1b_ar_tok_s": 700.0,
}


def run_part(name: str, argv: list[str], out: Path, limit_s: float) -> dict:
    """Run one part in a child process (``argv`` after the Python executable); its log goes to
    ``out/<name>.log``. Returns ``{"ok", "seconds", "tail"}``."""
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, timeout=limit_s,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log.read_text(errors="replace").splitlines()[-15:]
    seconds = time.perf_counter() - t0
    print(f"[{name}] {'ok' if rc == 0 else f'FAILED ({rc})'} in {seconds:.0f} s", flush=True)
    if rc != 0:
        print("\n".join(tail), flush=True)
    return {"ok": rc == 0, "seconds": round(seconds, 1), "rc": rc, "tail": tail}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_argv(gguf: str, data: str, dtype: str, per_task: int, new: int, methods: str, out: Path,
               device: str) -> list[str]:
    return ["-m", "speculum", "bench", "--model", gguf, "--weights", "float", "--device", device, "--dtype", dtype,
            "--data", data, "--per-task", str(per_task), "--max-new-tokens", str(new), "--methods", methods,
            "--out", str(out), "--no-progress"]


def llama1b(out: Path, device: str, prompts: int = 4, new: int = 128, layers: int | None = None) -> None:
    """Part 2: ``ar`` tok/s of the random-weight 1.1B Llama (bfloat16, native runner, CUDA graphs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculum.drafters.ar import AutoregressiveDrafter
    from speculum.engine import Engine
    from speculum.runners import NativeRunner

    torch.manual_seed(0)
    cfg = LlamaConfig(**(LLAMA_1B | ({"num_hidden_layers": layers} if layers else {})))
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    engine = Engine(NativeRunner(model), AutoregressiveDrafter())
    rng = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, cfg.vocab_size, (200 + 50 * i,), generator=rng).tolist() for i in range(prompts)]
    engine.generate(ids[0], new)  # warm-up: graph captures
    times, tokens = [], 0
    for x in ids:
        sync()
        t0 = time.perf_counter()
        r = engine.generate(x, new)
        sync()
        times.append(time.perf_counter() - t0)
        tokens += len(r.tokens)
    result = {"tok_s": tokens / sum(times), "ms_per_token": 1000 * sum(times) / tokens, "prompts": prompts,
              "new_tokens": new, "params": sum(p.numel() for p in model.parameters())}
    (out / "llama1b.json").write_text(json.dumps(result, indent=1))
    print(result)


def step(gguf: str, out: Path, device: str, new: int = 128) -> None:
    """Part 3: one ``ar`` step of the packaged model in bfloat16: the engine step, the graph replay
    alone, and the kernels of one eager forward (torch's profiler)."""
    import torch

    import speculum
    from speculum.drafters.ar import AutoregressiveDrafter
    from speculum.engine import Engine
    from speculum.runners import NativeRunner
    from speculum.tree import DraftTree

    model, tok = speculum.load(gguf, dtype="bfloat16", device=device, weights="float")
    runner = NativeRunner(model)
    engine = Engine(runner, AutoregressiveDrafter(), tok)
    prompt = tok("Write a short story about a lighthouse keeper.")["input_ids"] * 20
    engine.generate(prompt, 32)  # warm-up
    sync()
    t0 = time.perf_counter()
    r = engine.generate(prompt, new)
    sync()
    engine_ms = 1000 * (time.perf_counter() - t0 - r.prefill_s) / max(1, len(r.tokens) - 1)
    result = {"engine_ms_per_token": engine_ms, "prompt_tokens": len(prompt)}
    graphs = runner.graphs
    one_token = [g for key, (g, _) in graphs.graphs.items() if key[0] == 1] if graphs is not None else []
    if one_token and graphs.capture:
        graph = one_token[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            graph.replay()
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        result["replay_ms"] = start.elapsed_time(end) / 200
    eager = NativeRunner(model, cuda_graphs=False)
    cache = eager.new_cache(len(prompt) + 8)
    eager.prefill(cache, prompt[:-1])
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        eager.forward(cache, prompt[-1], DraftTree.chain([]))
        sync()
    kind = "CUDA" if cuda else "CPU"
    kernels = [e for e in prof.events() if e.device_type.name == kind and (cuda or e.name.startswith("aten::"))]
    result["kernels_per_forward"] = len(kernels)
    table = prof.key_averages().table(sort_by=f"{kind.lower()}_time_total", row_limit=25)
    (out / "step_kernels.txt").write_text(table)
    (out / "step.json").write_text(json.dumps(result, indent=1))
    print(result)


def _overall(path: Path) -> dict:
    data = json.loads((path / "results.json").read_text())
    return {m: v["overall"] for m, v in data["methods"].items()}


def report(out: Path, parts: dict, env: dict) -> str:
    """The Markdown table (and the checks against the issue's targets)."""
    lines = [f"# GPU check: {env.get('gpu')}", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, Python {env.get('python')}", ""]
    checks = []
    lines += ["| what | tok/s | x `ar` | x `hf_compiled` | tokens/step | draft ms/step | verify ms/step |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    bf16 = _overall(out / "bf16") if parts.get("bf16", {}).get("ok") else {}
    ar = bf16.get("ar", {}).get("tok_s")
    hfc = None  # hf_compiled's tok/s scaled to the main run's `ar` (its own run's ratio to `ar`)
    if parts.get("hfc", {}).get("ok") and ar:
        side = _overall(out / "hfc")
        hfc = ar * side["hf_compiled"]["tok_s"] / side["ar"]["tok_s"]
        lines.append(f"| SmolLM2-135M bf16 `hf_compiled` (own run: {side['hf_compiled']['tok_s']:.1f} tok/s against "
                     f"`ar`'s {side['ar']['tok_s']:.1f} there) | {hfc:.1f} | {hfc / ar:.2f} | 1.00 | 1.00 | | |")
    for m, v in bf16.items():
        x_ar = v["tok_s"] / ar if ar else None
        x_hfc = v["tok_s"] / hfc if hfc else None
        fmt = lambda x: "" if x is None else f"{x:.2f}"
        lines.append(f"| SmolLM2-135M bf16 `{m}` | {v['tok_s']:.1f} | {fmt(x_ar)} | {fmt(x_hfc)} | "
                     f"{v['mean_accepted']:.2f} | {v.get('draft_ms_per_step') or 0:.2f} | "
                     f"{v.get('verify_ms_per_step') or 0:.2f} |")
    if ar:
        auto, eagle = bf16.get("auto", {}).get("tok_s"), bf16.get("eagle", {}).get("tok_s")
        checks.append(("`auto` >= 1.3x `ar`", auto and auto / ar, TARGETS["auto_vs_ar"]))
        checks.append(("`eagle` >= 1.1x `ar`", eagle and eagle / ar, TARGETS["eagle_vs_ar"]))
        checks.append(("`ar` >= 800 tok/s", ar, TARGETS["ar_tok_s"]))
        if hfc:
            checks.append(("`auto` >= 4x `hf_compiled`", auto and auto / hfc, TARGETS["auto_vs_hf_compiled"]))
    if parts.get("llama1b", {}).get("ok"):
        r = json.loads((out / "llama1b.json").read_text())
        lines.append(f"| Llama 1.1B (random weights) bf16 `ar` | {r['tok_s']:.1f} | 1.00 | | 1.00 | | "
                     f"{r['ms_per_token']:.2f} |")
        checks.append(("1.1B `ar` >= 700 tok/s", r["tok_s"], TARGETS["llama1b_ar_tok_s"]))
    if parts.get("f32", {}).get("ok"):
        f32 = _overall(out / "f32")
        same = {m: v.get("identical_frac") for m, v in f32.items()}
        lines += ["", "float32 on the GPU, fraction of prompts whose output equals `ar`'s: "
                  + ", ".join(f"`{m}` {s:.2f}" for m, s in same.items())]
        checks.append(("float32: every method equals `ar`", min(same.values()), 1.0))
    if parts.get("step", {}).get("ok"):
        s = json.loads((out / "step.json").read_text())
        lines += ["", (f"One `ar` step (SmolLM2 bf16, {s['prompt_tokens']} prompt tokens): "
                  f"{s['engine_ms_per_token']:.2f} ms in the engine, graph replay "
                  f"{s.get('replay_ms', float('nan')):.2f} ms, {s['kernels_per_forward']} kernels per eager forward "
                  "(step_kernels.txt).")]
    lines += ["", "| check | measured | target | met |", "|---|---:|---:|---|"]
    for what, got, target in checks:
        lines.append(f"| {what} | {'' if got is None else f'{got:.2f}'} | {target} | "
                     f"{'yes' if got is not None and got >= target else 'NO'} |")
    lines += ["", "| part | ok | seconds |", "|---|---|---:|"]
    lines += [f"| {k} | {'yes' if v['ok'] else 'NO (' + str(v['rc']) + ')'} | {v['seconds']} |"
              for k, v in parts.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the packaged model's GGUF file (its stem finds the shipped heads)")
    ap.add_argument("--data", required=True, help="Spec-Bench JSONL (question_dev.jsonl)")
    ap.add_argument("--out", default="gpu-check", help="output directory")
    ap.add_argument("--parts", default="bf16,llama1b,f32,step,hfc", help="which parts to run, in order")
    ap.add_argument("--device", default="cuda", help="cuda (the check); cpu only for a dry run with --quick")
    ap.add_argument("--quick", action="store_true", help="a dry run: few prompts and tokens, a 2-layer 1.1B-wide Llama")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one in-process part
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "llama1b":
        return llama1b(out, args.device, **({"prompts": 2, "new": 8, "layers": 2} if args.quick else {}))
    if args.part == "step":
        return step(args.gguf, out, args.device, **({"new": 8} if args.quick else {}))
    import torch
    import transformers

    env = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    print(env, flush=True)
    me = [os.path.abspath(__file__), "--gguf", args.gguf, "--data", args.data, "--out", str(out),
          "--device", args.device] + (["--quick"] if args.quick else [])
    bf16, f32 = ((1, 8), (1, 8)) if args.quick else ((2, 128), (1, 64))
    plan = {
        "bf16": (bench_argv(args.gguf, args.data, "bfloat16", *bf16, BF16_METHODS, out / "bf16", args.device), 200),
        "llama1b": (me + ["--part", "llama1b"], 70),
        "f32": (bench_argv(args.gguf, args.data, "float32", *f32, F32_METHODS, out / "f32", args.device), 100),
        "step": (me + ["--part", "step"], 50),
        "hfc": (bench_argv(args.gguf, args.data, "bfloat16", *bf16, HFC_METHODS, out / "hfc", args.device), 130),
    }
    parts = {}
    for name in args.parts.split(","):
        argv, limit = plan[name]
        parts[name] = run_part(name, argv, out, limit)
    text = report(out, parts, env)
    (out / "gpu_check.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
