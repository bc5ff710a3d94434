"""Record mix's best chains (scores) and how far each was accepted, in speculum's engine with
chain verification; then evaluate chain-cut rules under a vLLM-like cost model offline."""
import json, sys, pickle
import torch
from speculum import load
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.drafters.base import Drafter
from speculum.bench.data import load_prompts

K = int(sys.argv[1]) if len(sys.argv) > 1 else 16
NAME = sys.argv[2] if len(sys.argv) > 2 else "mix"
torch.set_num_threads(2)
model, tok = load("default", "bfloat16")
m = build_method(NAME, model, tok)
inner = m.engine.drafter
log = []

class Rec(Drafter):
    name = "rec"
    def __init__(self, d): self.d = d; self.end_ids = d.end_ids
    def reset(self, p, params, g):
        self.d.end_ids = self.end_ids; self.d.reset(p, params, g)
    def propose(self, tokens, budget):
        c = self.d.propose(tokens, 64).best_chain()
        k = min(K, budget)
        if len(c) > k: c = c.subtree(list(range(k)))
        self.last = c
        return c
    def update(self, tokens, tree, acc, logits=None):
        self.d.update(tokens, tree, acc, logits)
        if len(tree):
            log.append((list(tree.scores or []), len(acc.path)))
    def finish(self, tokens): self.d.finish(tokens)
    def fork(self): return Rec(self.d.fork())

m.engine.drafter = Rec(inner)
qs = load_prompts("../shared/data/spec_bench/question_dev.jsonl", 5)
for q in qs:
    r = m.run(encode_prompt(tok, q.text, None), 128)
    print(q.task, r.new_tokens, len(r.steps), file=sys.stderr)
pickle.dump(log, open(f"/work/exp/chains_{NAME}_{K}.pkl", "wb"))
