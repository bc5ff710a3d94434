"""One engine's prefill (one kernel thread, bfloat16, the server's reproducible runner) of a
400-token Spec-Bench prompt: time, and torch.profiler's operator table."""
import time, torch
import speculum
from speculum.bench.data import load_prompts
from speculum.prompts import encode_prompt
from speculum.runners import runner_for
torch.set_num_threads(1)
model, tok = speculum.load("default", dtype="bfloat16")
runner = runner_for(model).invariant(65)  # as `speculum serve` (max_tree 64)
ps = load_prompts("../shared/data/spec_bench/question_dev.jsonl")
ids = max((encode_prompt(tok, p.text) for p in ps[:40]), key=len)[:400]
while len(ids) < 400: ids = ids + ids
ids = ids[:400]
def once():
    cache = runner.new_cache(1024)
    t = time.perf_counter(); runner.prefill(cache, ids); return time.perf_counter() - t
for _ in range(3): print("prefill 400:", once())
ts = [once() for _ in range(5)]; print("min", min(ts), "tok/s", 400 / min(ts))
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3): once()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
