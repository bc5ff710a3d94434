import speculum
from speculum.bench.data import load_prompts
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for
from speculum.sampling import SamplingParams
model, tok = speculum.load("default", dtype="bfloat16")
runner = runner_for(model).invariant(65)
prompts = [encode_prompt(tok, p.text) for p in load_prompts("../shared/data/spec_bench/question_dev.jsonl", per_task=1)]
params = SamplingParams(frequency_penalty=0.5)
ar, mix = (build_method(m, model, tok, runner=runner, chains_only=True) for m in ("ar", "mix"))
for p in prompts:
    want = ar.run(p, 128, params)
    got = mix.run(p, 128, params)
    print(got.tokens == want.tokens, round(got.mean_accepted, 2), flush=True)
