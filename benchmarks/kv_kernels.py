"""Decode speed and memory of the KV policies whose reads the KV kernels serve (``kv_quant``, ``gear``,
``tidal``, ``quest``, ``zipcache``) against the full cache, at one long context.

One layer-by-layer prefill of a RULER-style prompt gives every layer's keys and values (and, for a policy
whose prefill reads prompt queries, ZipCache's, the queries of the rows it asks for); each policy's
cache is filled from them (as its own prefill would fill it), so that the run costs one prefill
however many policies it compares. Then, round after round, each configuration decodes ``--new``
greedy tokens in turn (alternating, after a warm-up round), so that they see the machine in the
same state; tok/s are reported per round and as the median ratio to ``full`` within each round.

Memory: the KV bytes each cache holds, and the rise of the process's peak resident memory above
its resident memory at the start of a configuration's decoding (``VmHWM`` reset through
``/proc/self/clear_refs``): what a step allocates beyond the cache (gathered copies, dequantized
layers, scores).

    PYTHONPATH=src python benchmarks/kv_kernels.py --length 8192 --new 24 --rounds 3 \\
        --policies full,kv_quant,kv_quant:bits=2,gear,zipcache,tidal,quest [--weights float --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--new", type=int, default=24, help="tokens decoded per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--policies", default="full,kv_quant,kv_quant:bits=2,tidal,quest")
    p.add_argument("--budget", default="0.25")
    p.add_argument("--weights", default="auto", help="as speculum.load's (auto: the GGUF, float32)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="", help="write the records here")
    p.add_argument("--prompt-kv", default="", help="a file with the prompt's keys and values: loaded where it "
                   "exists (cast to the run's dtype), else written after the prefill")
    return p.parse_args()


def prompt_ids(tokenizer, length: int) -> list[int]:
    from speculum.bench.longctx import encode_task
    from speculum.bench.ruler import make_task

    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return encode_task(tokenizer, make_task("niah_single", length, 0, count))[0]


def query_rows(specs: list[str], budget: str, n: int) -> torch.Tensor | None:
    """The prompt rows ``[w]`` whose queries the policies' prefills read (one policy's rows: ZipCache's), or
    None where none reads queries."""
    from speculum.kv import make_policy

    policies = [(s, make_policy(s, budget)) for s in specs]
    for spec, p in policies:
        if p is not None and p.prefill_scores not in (None, "queries"):
            raise SystemExit(f"{spec}'s prefill needs the prompt's {p.prefill_scores!r} attention scores, which this "
                             "benchmark's shared prefill does not compute (it gives prompt queries only): measure it "
                             "with `speculum longctx`")
    rows = [p.query_rows(n) for _, p in policies if p is not None and p.prefill_scores == "queries"]
    if any(not torch.equal(r, rows[0]) for r in rows):
        raise SystemExit("the policies read the queries of different prompt rows: compare them in separate runs")
    return rows[0] if rows else None


def layer_kvs(runner, ids: list[int], rows: torch.Tensor | None) -> tuple[list[torch.Tensor], list, int]:
    """Every layer's prompt keys and values ``[2, H_kv, n, d]``, its queries ``[w, H, d]`` of prompt rows
    ``rows`` (None without rows) and the first generated token."""
    from speculum.runners.layerwise import prefill_layerwise

    kvs: list[torch.Tensor] = []
    queries: list = []

    def store(i, sliding, kv, scores):
        kvs.append(kv.clone())
        queries.append(None if rows is None else scores.clone())

    logits = prefill_layerwise(runner.decoder, ids, runner.prefill_chunk, None if rows is None else "queries",
                               32 if rows is None else rows, store)
    return kvs, queries, int(logits[-1].argmax())


def filled_cache(runner, spec: str, budget: str, kvs: list[torch.Tensor], queries: list, capacity: int):
    """(runner, cache) for ``spec``, the cache holding the prompt as that policy's prefill leaves it."""
    from speculum.kv import make_policy
    from speculum.runners import under_policy

    policy = make_policy(spec, budget)
    n = kvs[0].shape[2]
    if policy is None:
        cache = runner.new_cache(capacity)
        cache.reserve(n)
        for i, kv in enumerate(kvs):
            cache.kv[i, :, :, :n] = kv
        cache.length = n
        return runner, cache
    r = under_policy(runner, policy)
    cache = r.new_cache(capacity)
    policy.begin_prefill(cache, n)
    layout = runner.layout
    for i, kv in enumerate(kvs):
        policy.store_prefill(cache, i, layout.is_sliding(i), kv, queries[i])
    policy.end_prefill(cache, n)
    return r, cache


def decode(runner, cache, first: int, new: int) -> tuple[float, list[int]]:
    from speculum.tree import DraftTree

    empty = DraftTree.chain([])
    tok, out = first, []
    t = time.perf_counter()
    for _ in range(new):
        logits = runner.forward(cache, tok, empty).logits
        runner.commit(cache)
        tok = int(logits[-1].argmax())
        out.append(tok)
    return time.perf_counter() - t, out


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import speculum
    from speculum.bench.longctx import peak_rss, reset_peak_rss
    from speculum.runners import runner_for

    model, tok = speculum.load("default", dtype=args.dtype, weights=args.weights)
    runner = runner_for(model, "native")
    ids = prompt_ids(tok, args.length)
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    rows = query_rows(specs, args.budget, len(ids))
    t = time.perf_counter()
    saved = torch.load(args.prompt_kv) if args.prompt_kv and os.path.exists(args.prompt_kv) else None
    if saved is not None and (rows is None or torch.equal(saved.get("rows", torch.empty(0)), rows)):
        kvs, first = [kv.to(runner.dtype) for kv in saved["kvs"]], saved["first"]
        queries = [None if q is None or rows is None else q.to(runner.dtype) for q in saved.get("queries", [None] * len(kvs))]
        assert saved["ids"] == ids, "the saved prompt is another prompt"
    else:
        kvs, queries, first = layer_kvs(runner, ids, rows)
        if args.prompt_kv:
            torch.save({"kvs": kvs, "queries": queries, "rows": rows, "first": first, "ids": ids}, args.prompt_kv)
    print(f"{len(ids)} prompt tokens, prefill {time.perf_counter() - t:.1f} s, dtype {runner.dtype}, "
          f"weights {model.speculum_weights}, threads {torch.get_num_threads()}", flush=True)
    capacity = len(ids) + (args.rounds + 1) * args.new + 64
    runs = {spec: filled_cache(runner, spec, args.budget, kvs, queries, capacity) for spec in specs}
    del kvs, queries
    gc.collect()
    records = []
    last = {spec: first for spec in specs}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for spec in specs:
            r, cache = runs[spec]
            gc.collect()
            reset_peak_rss()
            start = peak_rss("VmRSS")
            seconds, out = decode(r, cache, last[spec], args.new if rnd else 4)  # the caches grow alike
            last[spec] = out[-1]
            rise = (peak_rss() or 0) - (start or 0)
            if rnd:
                records.append({"round": rnd, "policy": spec, "tok_s": args.new / seconds,
                                "kv_bytes": cache.nbytes(), "peak_rise_bytes": rise, "tokens": out})
                print(f"round {rnd} {spec:18s} {args.new / seconds:7.2f} tok/s  kv {cache.nbytes() / 2**20:7.1f} MiB"
                      f"  peak rise {rise / 2**20:6.1f} MiB", flush=True)
    print("\npolicy              tok/s (median)  ratio to full (median of rounds)  kv MiB  peak rise MiB (max)")
    for spec in specs:
        rs = [r for r in records if r["policy"] == spec]
        ratios = []
        for rec in rs:
            base = [x for x in records if x["policy"] == "full" and x["round"] == rec["round"]]
            if base:
                ratios.append(rec["tok_s"] / base[0]["tok_s"])
        ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
        print(f"{spec:18s}  {statistics.median(r['tok_s'] for r in rs):14.2f}  {ratio:>32s}  "
              f"{rs[-1]['kv_bytes'] / 2**20:6.1f}  {max(r['peak_rise_bytes'] for r in rs) / 2**20:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
