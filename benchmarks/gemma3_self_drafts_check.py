"""Every self-drafter (and ``lookahead``) on the packaged Gemma-3-270M, float32, chains and trees:
greedy output equal to ``ar``'s, on a prompt past the 512-token sliding window and on a short one.
The suite checks ``kv_draft`` alone there (``tests/test_real_models.py``: Gemma's float32 forwards
are dear); this runs the rest by hand (~4 minutes). Prints one line per method and shape, and
exits non-zero if any output differs.

    .venv/bin/python benchmarks/gemma3_self_drafts_check.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_real_models import FLAT_COST, PROMPTS, SELF_DRAFTS

import speculum
from speculum.methods import build_method
from speculum.prompts import encode_prompt
from speculum.runners import runner_for

NEW = 48
TREE = {"top_k": 4, "max_nodes": 16}


def main() -> int:
    model, tok = speculum.load("gemma3", dtype="float32")
    runner = runner_for(model)
    failed = 0
    for text in (PROMPTS[-1] * 3, PROMPTS[0] * 2):
        ids = encode_prompt(tok, text, chat=False)
        ref = build_method("ar", model, tok, runner=runner).run(ids, NEW).tokens
        for name, (kind, options) in SELF_DRAFTS.items():
            for shape in ({}, TREE) if kind != "lookahead" else ({},):
                out = build_method(kind, model, tok, runner=runner, cost_model=FLAT_COST, **options, **shape).run(ids, NEW)
                same = out.tokens == ref
                failed += not same
                print(f"{len(ids)} prompt tokens  {name:16s} {'tree' if shape else 'chain':5s} "
                      f"{'equal to ar' if same else 'DIFFERS'}  {out.mean_accepted:.2f} tokens/step", flush=True)
    print("PASS" if not failed else f"FAIL: {failed} outputs differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
