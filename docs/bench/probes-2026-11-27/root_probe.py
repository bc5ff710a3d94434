import sys, torch, collections
from speculum import load
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.bench.data import load_prompts
torch.set_num_threads(2)
model, tok = load("default", "bfloat16")
m = build_method("quant_self", model, tok)
d = m.engine.drafter
stats = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0.0])
orig_update = d.update
def upd(tokens, tree, acc, logits=None):
    s = stats["root" if d.looked_up_root else "model"]
    s[0] += 1; s[1] += len(acc.path); s[2] += len(tree)
    orig_update(tokens, tree, acc, logits)
d.update = upd
NMIN = int(sys.argv[1]) if len(sys.argv) > 1 else 2
from speculum.tree import DraftTree
orig_prop = d.text.propose
def prop(tokens, budget):
    d.text._index_upto(tokens)
    mt = d.text._match(tokens)
    if mt is None or mt[0] < NMIN: return DraftTree()
    return orig_prop(tokens, budget)
d.text.propose = prop
qs = load_prompts("../shared/data/spec_bench/question_dev.jsonl", 3)
tot = [0, 0.0, 0.0]
for q in qs:
    r = m.run(encode_prompt(tok, q.text, None), 128)
    for st in r.steps:
        pass
    tot[0] += r.new_tokens; tot[1] += sum(s.draft_s for s in r.steps); tot[2] += sum(s.verify_s for s in r.steps)
for k, (n, a, l, _, _) in stats.items():
    print(k, "steps", n, "acc/step", a / n, "nodes/step", l / n)
print("draft ms/step", 1000 * tot[1] / sum(s[0] for s in stats.values()))
