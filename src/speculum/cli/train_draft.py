"""``speculum train-draft``: a learned draft head trained by self-distillation."""

from __future__ import annotations

from ..train import trainable
from .common import DTYPE_HELP


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train-draft", help="train a learned draft head for a model by self-distillation",
        description="Train a draft head (--kind) for --model. The model first answers the project's own "
                    "training prompts (templates over chat, writing, translation, summaries, questions, maths, "
                    "code and retrieval; text from Python's standard library; questions the model writes "
                    "itself; never Spec-Bench's), keeping its hidden states; then the head learns to predict "
                    "them. Every stage resumes from --out when interrupted. Writes OUT/<kind>.safetensors "
                    "(load it with --draft-head), report.json and loss.png (losses, held-out top-1 accuracy "
                    "by draft depth).")
    t.add_argument("--kind", default="eagle", choices=trainable(),
                   help="the head to train (default: %(default)s); kinds trained into one --out share its data")
    t.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    t.add_argument("--out", required=True, help="directory for data, checkpoints, the head and its report")
    t.add_argument("--prompts", type=int, default=1600, help="training prompts (default: %(default)s)")
    t.add_argument("--self-prompts", type=int, default=160,
                   help="of --prompts, how many the model writes itself (default: %(default)s)")
    t.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default: %(default)s)")
    t.add_argument("--batch", type=int, default=16, help="requests answered at once (default: %(default)s)")
    t.add_argument("--dtype", default="auto", help="the model's dtype while it answers: " + DTYPE_HELP)
    t.add_argument("--epochs", type=int, default=None, help="passes over the data (default: eagle 10, medusa, hydra and clover 4, kangaroo 5, ppd 1)")
    t.add_argument("--vocab", type=int, default=None,
                   help="draft vocabulary: the N most frequent response tokens (FR-Spec); 0 = the whole "
                        "vocabulary (default: 8192; ppd drafts through the target's own LM head: 0)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3; ppd 1e-2)")
    t.add_argument("--unroll", type=int, default=2,
                   help="training passes on the head's own predicted features (default: %(default)s)")
    t.add_argument("--heads", type=int, default=None,
                   help="medusa / hydra / clover: heads, ppd: prompt tokens, i.e. the draft depth (default: 4; ppd 3)")
    t.add_argument("--ensemble", type=int, default=None,
                   help="ppd: embeddings per prompt position, their logits averaged (EPT; default: 1)")
    t.add_argument("--max-samples", type=int, default=None,
                   help="train on at most this many of the data's samples (default: all; ppd 600)")
    t.add_argument("--exit-layer", type=int, default=2,
                   help="kangaroo: the target layers its draft runs before the adapter (default: %(default)s)")
    t.add_argument("--layout", default=None, choices=["speculum", "eagle1"],
                   help="eagle: the head's layout; 'eagle1' (no fc bias, no input norm: EAGLE-1's reference layout) "
                        "is the one vLLM loads, see export-head (default: speculum)")
    t.add_argument("--seed", type=int, default=0, help="prompt set, sampling and initialisation seed")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=None)


def run(args) -> int:
    from dataclasses import fields

    from ..train import DraftTraining, train_draft

    options = {f.name: getattr(args, f.name) for f in fields(DraftTraining) if f.name != "kind"}
    options["self_prompts"] = min(args.self_prompts, args.prompts // 2)
    job = DraftTraining.for_kind(args.kind, **options)
    summary = train_draft(job, progress=not args.no_progress)
    depths = ", ".join(f"{a:.3f}" for a in summary["top1_by_depth"])
    print(f"wrote {summary['head']} ({summary['samples']} samples, {summary['tokens']} response tokens, "
          f"{summary['total_seconds']} s); held-out top-1 by depth: {depths}")
    print(f"report: {summary['report']}, {summary['plot']}")
    return 0
