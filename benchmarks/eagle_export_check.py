"""Does an exported EAGLE head accept as much in vLLM as in speculum?

Exports ``--head`` (trained with ``train-draft --kind eagle --layout eagle1``) with
``speculum export-head --format eagle``, then drafts with it on the same prompts both ways, greedy,
chains of ``--k`` tokens through the whole vocabulary (what vLLM's EAGLE proposer drafts):

- speculum: ``eagle`` with ``top_k=1, depth=k, full_vocab=True`` (a chain of the head's argmax
  tokens), mean tokens per step = 1 + accepted / steps that drafted;
- vLLM: ``benchmarks/vllm_proposers.py --methods vllm_eagle:K`` in vLLM's venv, the same ratio
  from vLLM's spec-decode counters.

Run from the repository root in speculum's venv::

    .venv/bin/python benchmarks/eagle_export_check.py --head heads/eagle.safetensors \\
        --vllm-python .venv-vllm/bin/python --out bench-out/eagle-export
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from vllm_proposers import choose_prompts


def speculum_tokens_per_step(head: str, prompts: list[str], k: int, max_tokens: int, dtype: str) -> float:
    import speculum
    from speculum import load

    model, tok = load("default", dtype)
    method = speculum.build_method("eagle", model, tok, draft_head=head, top_k=1, depth=k, full_vocab=True,
                                   min_path_prob=0.0, sized=False, max_tree=k)
    drafts = accepted = 0
    for text in prompts:
        result = method.run(speculum.encode_prompt(tok, text), max_new_tokens=max_tokens)
        drafted = [s for s in result.steps if s.drafted]
        drafts += len(drafted)
        accepted += sum(s.accepted for s in drafted)
    return 1 + accepted / drafts


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--head", required=True, help="an eagle head in the eagle1 layout")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--data", default=str(REPO.parent / "shared/data/spec_bench/question_dev.jsonl"))
    p.add_argument("--per-task", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench-out/eagle-export")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "speculum", "export-head", args.head, "--format", "eagle",
                    "--out", str(out / "vllm-eagle")], check=True)
    _, sets = choose_prompts(args.data, args.per_task, [1])
    ours = speculum_tokens_per_step(args.head, sets[1], args.k, args.max_tokens, args.dtype)
    code = "import speculum.models as m; print(m._location('default', True))"
    model_dir = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    subprocess.run([args.vllm_python, str(REPO / "benchmarks" / "vllm_proposers.py"), "--model-dir", model_dir,
                    "--methods", f"vllm_eagle:{args.k}", "--eagle-dir", str(out / "vllm-eagle"),
                    "--concurrency", "1", "--per-task", str(args.per_task), "--max-tokens", str(args.max_tokens),
                    "--dtype", args.dtype, "--data", args.data, "--out", str(out / "vllm")], check=True)
    (row,) = json.loads((out / "vllm" / "results.json").read_text())["rows"]
    theirs = row["tokens_per_step"]
    result = {"head": args.head, "k": args.k, "prompts": len(sets[1]), "dtype": args.dtype,
              "speculum_tokens_per_step": round(ours, 3), "vllm_tokens_per_step": round(theirs, 3),
              "vllm_over_speculum": round(theirs / ours, 3)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
