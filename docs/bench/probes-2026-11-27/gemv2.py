import time, torch, sys, statistics
torch.set_num_threads(int(sys.argv[1]))
ws = [torch.randn(3072, 576).to(torch.bfloat16) for _ in range(90)]
pk = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
tot = sum(w.numel() * 2 for w in ws)
xs = {m: torch.randn(m, 576, dtype=torch.bfloat16) for m in (1, 2, 3, 4, 8)}
res = {m: [] for m in xs}; res["read"] = []
for rep in range(8):
    for m, x in xs.items():
        t = time.perf_counter()
        for p in pk: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
        res[m].append(time.perf_counter() - t)
    t = time.perf_counter()
    for w in ws: w.sum()
    res["read"].append(time.perf_counter() - t)
for k, v in res.items():
    dt = statistics.median(v[1:])
    print(f"M={k}: {dt*1e3:.1f} ms {tot/dt/1e9:.1f} GB/s")
