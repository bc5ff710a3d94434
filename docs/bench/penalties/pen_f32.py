import speculum
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.sampling import SamplingParams
model, tok = speculum.load("default", dtype="float32")
prompts = [encode_prompt(tok, p.text) for p in load_prompts("../shared/data/spec_bench/question_dev.jsonl", per_task=1)]
params = SamplingParams(frequency_penalty=0.5)
ar, mix, auto = (build_method(m, model, tok) for m in ("ar", "mix", "auto"))
same = 0
for p in prompts:
    want = ar.run(p, 64, params).tokens
    got = [mix.run(p, 64, params).tokens, auto.run(p, 64, params).tokens]
    same += all(g == want for g in got)
    print(len(p), [g == want for g in got], want != ar.run(p, 64).tokens, flush=True)
print("identical", same, "of", len(prompts))
