"""quant_self drafts and is verified; a mix twin proposes on the same contexts. After the run, each
step's trees are matched against the final greedy output: how far would each (and their union) go?"""
import sys, pickle, time, torch
from speculum import load
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.drafters.base import Drafter
from speculum.drafters import DRAFTERS
from speculum.bench.data import load_prompts

torch.set_num_threads(2)
model, tok = load("default", "bfloat16")
m = build_method(sys.argv[1] if len(sys.argv) > 1 else "quant_self", model, tok)
inner = m.engine.drafter
mix = DRAFTERS["mix"].factory()
from speculum.drafters.ngram import NgramDrafter
ng = NgramDrafter()
rec = []

def longest(tree, truth):
    """accepted depth of tree against the true continuation list"""
    best, depth = 0, {}
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        d = 0 if p < 0 else depth.get(p, -99)
        if d >= 0 and d < len(truth) and truth[d] == t:
            depth[i] = d + 1; best = max(best, d + 1)
        else:
            depth[i] = -99
    return best

class Twin(Drafter):
    name = "twin"
    def __init__(s, d, x): s.d, s.x = d, x; s.end_ids = d.end_ids
    @property
    def reads_cache(s): return s.d.reads_cache
    @property
    def hidden_layers(s): return s.d.hidden_layers
    def see_cache(s, c): s.d.see_cache(c)
    def see_hidden(s, h): s.d.see_hidden(h)
    def reset(s, p, params, g):
        s.d.end_ids = s.x.end_ids = ng.end_ids = s.end_ids; s.d.reset(p, params, g); s.x.reset(p, params, g); ng.reset(p, params, g)
    def propose(s, tokens, budget):
        t0 = time.perf_counter(); tree = s.d.propose(tokens, budget); t1 = time.perf_counter()
        xt = {b: s.x.propose(tokens, b) for b in (4, 8, 16)}
        ngt = ng.propose(tokens, 16); m = ng._match(tokens)
        s.cur = dict(pos=len(tokens), q=tree, m=xt, qs=t1 - t0, ng=ngt, ngn=(m[0] if m else 0)); return tree
    def update(s, tokens, tree, acc, logits=None):
        s.d.update(tokens, tree, acc, logits); s.x.update(tokens, tree, acc, logits); ng.update(tokens, tree, acc, logits)
        s.cur["acc"] = len(acc.path); s.cur["v"] = tree; rec.append(s.cur)
    def finish(s, tokens):
        s.d.finish(tokens); s.x.finish(tokens); ng.finish(tokens)
        for r in rec:
            if "truth" not in r: r["truth"] = tokens[r["pos"]:r["pos"] + 40]

m.engine.drafter = Twin(inner, mix)
qs = load_prompts("../shared/data/spec_bench/question_dev.jsonl", 3)
for q in qs:
    r = m.run(encode_prompt(tok, q.text, None), 128)
    print(q.task, r.new_tokens, len(r.steps), file=sys.stderr, flush=True)
n = len(rec)
for r in rec: r["aq"] = longest(r["v"], r["truth"])
print("steps", n, "quant_self verified tree: acc", sum(r["aq"] for r in rec) / n, "engine", sum(r["acc"] for r in rec) / n,
      "nodes", sum(len(r["v"]) for r in rec) / n, "draft ms", 1000 * sum(r["qs"] for r in rec) / n)
for b in (4, 8, 16):
    am = [longest(r["m"][b], r["truth"]) for r in rec]
    print(f"mix budget {b}: acc {sum(am)/n:.2f} nodes {sum(len(r['m'][b]) for r in rec)/n:.1f} "
          f"union acc {sum(max(a, r['aq']) for a, r in zip(am, rec))/n:.2f}  mix>=3 on {sum(a >= 3 for a in am)/n:.2f}")

import bisect
ROWS = [1, 2, 4, 8, 12, 16, 24, 32]; MS = [21.0, 20.2, 21.8, 24.1, 26.1, 28.4, 32.2, 36.4]  # bf16 ctx 512 calibration
def vcost(rows):
    rows = max(1, rows); i = min(bisect.bisect_left(ROWS, rows), len(ROWS) - 1)
    if ROWS[i] == rows or i == 0: return MS[i]
    a, b = ROWS[i - 1], ROWS[i]; return MS[i - 1] + (MS[i] - MS[i - 1]) * (rows - a) / (b - a)
def evaluate(name, pick):
    tok = ms = 0
    for r in rec:
        acc, rows, draft = pick(r)
        tok += acc + 1; ms += draft + vcost(rows + 1)
    print(f"{name:28s} tokens/step {tok/len(rec):.2f}  ms/token {ms/tok:.2f}")
evaluate("quant_self", lambda r: (r["aq"], len(r["v"]), 1000 * r["qs"]))
evaluate("ngram alone", lambda r: (longest(r["ng"], r["truth"]), len(r["ng"]), 0.3))
evaluate("mix16 alone", lambda r: (longest(r["m"][16], r["truth"]), len(r["m"][16]), 0.5))
for n_min in (1, 2, 3):
  for L in (1, 4, 8):
    evaluate(f"ngram if n>={n_min} & len>={L}", lambda r: (longest(r["ng"], r["truth"]), len(r["ng"]), 0.3)
             if r["ngn"] >= n_min and len(r["ng"]) >= L else (r["aq"], len(r["v"]), 1000 * r["qs"]))
import collections
c = collections.Counter(r["ngn"] for r in rec); print("ngram match n:", sorted(c.items()))
pickle.dump([{k: v for k, v in r.items()} for r in rec], open("/work/exp/union_rec.pkl", "wb"))
