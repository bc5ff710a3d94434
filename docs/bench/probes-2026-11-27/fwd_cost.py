import random, statistics, time, sys
import torch, speculum
from speculum.runners import runner_for
from speculum.tree import DraftTree
torch.set_num_threads(1)
model, tok = speculum.load("default", dtype="bfloat16")
base = runner_for(model)
inv = base.invariant(17)
rng = random.Random(0)
for name, runner in (("invariant", inv), ("default", base)):
    ctx = 320
    pool = runner.new_pool(8, ctx + 400)
    caches = [pool.acquire() for _ in range(8)]
    t = time.perf_counter()
    for c in caches:
        runner.prefill(c, [rng.randrange(30000) for _ in range(ctx)])
    print(name, f"prefill {8*ctx/(time.perf_counter()-t):.0f} tok/s")
    for b in (1, 2, 4, 8):
        for r in (1, 2, 4):
            ts = []
            for rep in range(6):
                trees = [DraftTree.chain([rng.randrange(30000) for _ in range(r - 1)]) for _ in range(b)]
                t0 = time.perf_counter()
                runner.forward_batch(caches[:b], [rng.randrange(30000) for _ in range(b)], trees)
                if rep: ts.append(time.perf_counter() - t0)
                for c in caches[:b]: c.pending = 0
            print(f"{name} B={b} rows={r}: {1000*statistics.median(ts):.1f} ms")
