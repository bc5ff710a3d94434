import pickle, sys
log = pickle.load(open(sys.argv[1], "rb"))
def best_length(scores, c):
    best, br, g = 0, 1.0, 1.0
    for d, p in enumerate(scores):
        g += p; r = g / (1 + c * (d + 1))
        if r > br: best, br = d + 1, r
    return best
print("steps", len(log), "scored", sum(1 for s,_ in log if s))
# calibration: by score bucket, fraction of nodes accepted
import collections
b = collections.defaultdict(lambda: [0,0])
for s, a in log:
    for d, p in enumerate(s):
        k = min(int(p*10), 9); b[k][0] += 1; b[k][1] += d < a
for k in sorted(b): print(f"score {k/10:.1f}-{(k+1)/10:.1f}: n={b[k][0]} accepted={b[k][1]/b[k][0]:.2f}")
for c in (0.03, 0.06, 0.1):
    print(f"cost per row {c}")
    for rule in ["k=16", "k=8", "k=4", "best(c)", "best(c/2)", "best(2c)"]:
        tok = cost = 0
        for s, a in log:
            if rule.startswith("k="): k = min(int(rule[2:]), len(s) if s else 16)
            elif rule == "best(c)": k = best_length(s, c)
            elif rule == "best(c/2)": k = best_length(s, c/2)
            else: k = best_length(s, 2*c)
            if not s: k = min(k, 16)
            tok += min(a, k) + 1; cost += 1 + c * k
        print(f"  {rule:10s} tokens/step {tok/len(log):.2f}  tokens/cost {tok/cost:.3f}")
