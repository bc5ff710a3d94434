"""``speculum export-head``: a trained head written in the layout vLLM loads."""

from __future__ import annotations


def add_parser(sub) -> None:
    x = sub.add_parser("export-head", help="write a trained head in the layout vLLM loads",
                       description="Write a head from `speculum train-draft` as a vLLM draft model directory: "
                                   "--format eagle (vLLM's EagleLlamaForCausalLM; the head must have been trained "
                                   "with --layout eagle1) or medusa (vLLM's MedusaModel). Serve it with vLLM's "
                                   "--speculative-config '{\"method\": \"eagle\", \"model\": \"OUT\", "
                                   "\"num_speculative_tokens\": 4}' (docs/scale-out.md).")
    x.add_argument("head", help="the head file (.safetensors from train-draft)")
    x.add_argument("--format", required=True, choices=["eagle", "medusa"], help="vLLM's layout to write")
    x.add_argument("--model", default="default", help="the head's target, as for generate (default: %(default)s)")
    x.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors)")


def run(args) -> int:
    from ..heads.export import export_eagle, export_medusa
    from ..loading import load
    from ..models import load_tokenizer_and_config

    if args.format == "eagle":
        _, config = load_tokenizer_and_config(args.model)
        out = export_eagle(args.head, config, args.out)
    else:
        target, _ = load(args.model, "bfloat16", weights="float")  # vLLM runs the float model
        out = export_medusa(args.head, target, args.out)
    print(f"wrote {out} (vLLM: --speculative-config '{{\"method\": \"{args.format}\", \"model\": \"{out}\", "
          f"\"num_speculative_tokens\": 4}}')")
    return 0
