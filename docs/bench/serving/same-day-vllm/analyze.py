"""What timeline.py recorded: share of the wall time with k requests in flight, the tail after the
last request starts, each process's CPU use. usage: analyze.py OUT.json C"""
import json, sys
d = json.load(open(sys.argv[1])); res = d["res"]; t0 = d["t0"]; wall = d["wall"]; C = int(sys.argv[2]) if len(sys.argv) > 2 else 8
import numpy as np
ts = np.arange(0, wall, 0.01)
inflight = np.zeros_like(ts)
for r in res:
    inflight += (ts >= r["t0"] - t0) & (ts < r["end"] - t0)
for k in range(C + 1):
    print(k, f"{(inflight == k).mean()*100:.1f}%", end="  ")
print()
last_start = max(r["t0"] for r in res) - t0
print(f"wall {wall:.1f}; last request starts at {last_start:.1f}; tail after it {wall-last_start:.1f}s")
S = np.array([[x if x is not None else np.nan for x in s] for s in d["samples"]], dtype=float)
dt = S[-1, 0] - S[0, 0]
names = ["http"] + [f"engine{j}" for j in range(len(d["pids"]) - 1)] + ["client"]
for j, n in enumerate(names):
    print(n, f"{(S[-1, j+1]-S[0, j+1])/100/dt*100:.0f}% of a core")
# engines' CPU during the time when inflight==C
mid = (S[:, 0] - t0 < last_start)
Sm = S[mid]
dtm = Sm[-1, 0] - Sm[0, 0]
print("before the tail:", [f"{n} {(Sm[-1, j+1]-Sm[0, j+1])/100/dtm*100:.0f}%" for j, n in enumerate(names)])
tt = [r['first'] - r['t0'] for r in res]; print("ttft median", np.median(tt), "max", max(tt))
print("chunks/token", sum(r['chunks'] for r in res) / sum(r['tokens'] for r in res))
print("prompt tokens mean", np.mean([r['prompt'] for r in res]))
