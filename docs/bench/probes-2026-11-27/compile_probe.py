import time, statistics, torch, torch.nn.functional as F, sys
torch.set_num_threads(int(sys.argv[1]))
D, I, L = 576, 1536, 30
class Block(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.n1 = torch.nn.Parameter(torch.ones(D)); s.n2 = torch.nn.Parameter(torch.ones(D))
        s.qkv = torch.nn.Linear(D, 960, bias=False); s.o = torch.nn.Linear(D, D, bias=False)
        s.gu = torch.nn.Linear(D, 2 * I, bias=False); s.down = torch.nn.Linear(I, D, bias=False)
    def forward(s, x):
        h = F.rms_norm(x, (D,), s.n1, 1e-5)
        q = s.qkv(h)[:, :D]                   # stand-in for attention
        x = x + s.o(q)
        h = F.rms_norm(x, (D,), s.n2, 1e-5)
        g, u = s.gu(h).chunk(2, -1)
        return x + s.down(F.silu(g) * u)
class Net(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.blocks = torch.nn.ModuleList(Block() for _ in range(L))
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return x
net = Net().to(torch.bfloat16).eval()
x = torch.randn(1, D, dtype=torch.bfloat16)
def bench(f, n=30):
    with torch.no_grad():
        for _ in range(5): f(x)
        ts = []
        for _ in range(n):
            t = time.perf_counter(); f(x); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
print("eager", bench(net))
import torch._inductor.config as cfg
cfg.freezing = True
with torch.no_grad():
    c = torch.compile(net)
    t = time.perf_counter(); c(x); print("compile s", time.perf_counter() - t)
print("compiled", bench(c))
print("eager", bench(net))
print("compiled", bench(c))
from speculum.runners.packed import packed_linear
class PBlock(torch.nn.Module):
    def __init__(s, b):
        super().__init__(); s.b = b
        s.qkv, s.o, s.gu, s.down = (packed_linear(m.weight) for m in (b.qkv, b.o, b.gu, b.down))
    def forward(s, x):
        b = s.b
        h = F.rms_norm(x, (D,), b.n1, 1e-5)
        q = s.qkv(h)[:, :D]
        x = x + s.o(q)
        h = F.rms_norm(x, (D,), b.n2, 1e-5)
        g, u = s.gu(h).chunk(2, -1)
        return x + s.down(F.silu(g) * u)
pblocks = [PBlock(b) for b in net.blocks]
def pnet(x):
    for b in pblocks: x = b(x)
    return x
for _ in range(2):
    print("eager packed", bench(pnet))
    print("compiled", bench(c))
for rows in (4, 16):
    x = torch.randn(rows, D, dtype=torch.bfloat16)
    with torch.no_grad(): c(x)  # compile this shape
    for _ in range(2):
        print(rows, "eager packed", bench(pnet), "compiled", bench(c))
