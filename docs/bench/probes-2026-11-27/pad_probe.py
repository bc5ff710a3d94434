import sys, time, statistics, random, torch
PAD = int(sys.argv[1]); torch.set_num_threads(2)
import speculum.runners.packed as P
orig = P.packed_linear
def padded(weight, bias=None):
    f = orig(weight, bias)
    if f is None or weight.dtype != torch.bfloat16 or PAD <= 1: return f
    def g(x):
        n = x.shape[0] if x.dim() == 2 else x.reshape(-1, x.shape[-1]).shape[0]
        if x.dim() == 2 and n < PAD:
            return f(torch.cat([x, x.new_zeros(PAD - n, x.shape[1])]))[:n]
        return f(x)
    return g
P.packed_linear = padded
import speculum.runners.decoder as Dm
for mod in list(sys.modules.values()):
    if getattr(mod, "packed_linear", None) is orig: mod.packed_linear = padded
import speculum
from speculum.runners import runner_for
from speculum.tree import DraftTree
model, tok = speculum.load("default", dtype="bfloat16")
runner = runner_for(model)
rng = random.Random(0)
cache = runner.new_cache(400)
runner.prefill(cache, [rng.randrange(30000) for _ in range(300)])
for r in (1, 2, 4):
    ts = []
    for rep in range(25):
        tree = DraftTree.chain([rng.randrange(30000) for _ in range(r - 1)])
        t0 = time.perf_counter(); runner.forward_tree(cache, rng.randrange(30000), tree); 
        if rep > 2: ts.append(time.perf_counter() - t0)
        cache.pending = 0
    print(f"pad={PAD} rows={r}: {1000*statistics.median(ts):.1f} ms")
