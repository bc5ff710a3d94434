"""One serve-like engine in-process, 1 kernel thread: core-seconds per request at batch B."""
import sys, time, cProfile, pstats
import torch
import speculum
from speculum.batching import Batcher, BatchRequest
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

torch.set_num_threads(1)
batches = [int(x) for x in sys.argv[1].split(",")]
prof = len(sys.argv) > 2 and sys.argv[2] == "prof"
model, tok = speculum.load("default", dtype="bfloat16")
runner = runner_for(model).invariant(17)
chosen = load_prompts("../shared/data/spec_bench/question_dev.jsonl", per_task=5)
prompts = [encode_prompt(tok, p.text) for p in chosen]
warm, prompts = prompts[::5], [p for i, p in enumerate(prompts) if i % 5]
print(len(prompts), "prompts, mean len", sum(map(len, prompts)) / len(prompts))
for b in batches:
    method = build_method("auto", model, tok, runner=runner, chains_only=True)
    batcher = Batcher(runner, max_batch=b)
    batcher.run([BatchRequest(method.engine, p, 16) for p in warm[:b]])
    pr = cProfile.Profile() if prof else None
    t0 = time.perf_counter(); c0 = time.process_time()
    if pr: pr.enable()
    results = batcher.run([BatchRequest(method.engine, p, 64) for p in prompts])
    if pr: pr.disable()
    wall = time.perf_counter() - t0; cpu = time.process_time() - c0
    steps = [s for r in results for s in r.steps]
    tokens = sum(r.new_tokens for r in results)
    pre = sum(getattr(r, "prefill_s", 0) for r in results)
    print(f"B={b}: {tokens} tokens in {wall:.1f} s ({tokens/wall:.1f} tok/s), cpu {cpu:.1f}, "
          f"{wall/len(prompts):.2f} s/request, committed/step {sum(s.committed for s in steps)/len(steps):.2f}, "
          f"drafted/step {sum(s.drafted for s in steps)/len(steps):.2f}")
    if pr:
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
