"""One serve-like engine in-process, 1 kernel thread: methods interleaved at batch B.

usage: engine_ab.py BATCHES METHOD[:key=value...],... [ROUNDS]. The option ``batch_arms=a+b``
(``auto`` only) replaces auto's batched bandit arms; it applies only to commits 2c0b714 to
81d714d (the first version), whose AutoDrafter kept a bandit of its own for batched steps
(``batch_rates``, ``_clocks``)."""
import sys, time
import torch
import speculum
from speculum.batching import Batcher, BatchRequest
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

torch.set_num_threads(1)
batches = [int(x) for x in sys.argv[1].split(",")]
specs = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
model, tok = speculum.load("default", dtype="bfloat16")
runner = runner_for(model).invariant(65)
chosen = load_prompts("../shared/data/spec_bench/question_dev.jsonl", per_task=5)
prompts = [encode_prompt(tok, p.text) for p in chosen]
warm, prompts = prompts[::5], [p for i, p in enumerate(prompts) if i % 5]
print(len(prompts), "prompts, mean len", sum(map(len, prompts)) / len(prompts), flush=True)
def opts(spec):
    name, *kv = spec.split(":")
    o = {}
    for x in kv:
        k, v = x.split("=")
        o[k] = {"False": False, "True": True}.get(v, v)
    return name, o
methods = {}
for s in specs:
    name, o = opts(s)
    batch_arms = o.pop("batch_arms", None)
    methods[s] = build_method(name, model, tok, runner=runner, chains_only=True, **o)
    if batch_arms:  # commits 2c0b714 to 81d714d only
        from speculum.drafters.rate_bandit import ArmRates
        d = methods[s].engine.drafter
        d.batch_rates = ArmRates(batch_arms.split("+"), d.rates.gamma, d.rates.explore)
        d._clocks()
for r in range(rounds):
  for b in batches:
    for s in specs:
        method = methods[s]
        batcher = Batcher(runner, max_batch=b)
        if r == 0:
            batcher.run([BatchRequest(method.engine, p, 16) for p in warm[:b]])
        t0 = time.perf_counter()
        results = batcher.run([BatchRequest(method.engine, p, 64) for p in prompts])
        wall = time.perf_counter() - t0
        steps = [s_ for r_ in results for s_ in r_.steps]
        tokens = sum(r_.new_tokens for r_ in results)
        print(f"r{r} B={b} {s}: {tokens} tokens {wall:.1f} s ({tokens/wall:.1f} tok/s) committed/step {sum(x.committed for x in steps)/len(steps):.2f}", flush=True)
