"""A draft model cut from the target: its first ``--layers`` decoder layers, then its own final norm
and LM head, saved as a transformers directory for ``--draft-model`` (no training).

    .venv/bin/python benchmarks/truncated_copy.py --layers 24 --out /tmp/smollm2-first24
"""

import argparse

from speculum import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = load(args.model, "float32", weights="float")  # a savable float copy
    total = model.config.num_hidden_layers
    if not 1 <= args.layers < total:
        raise SystemExit(f"--layers must lie in 1..{total - 1}")
    model.model.layers = model.model.layers[:args.layers]
    model.config.num_hidden_layers = args.layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:args.layers]
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"saved the first {args.layers} of {total} layers to {args.out}")


if __name__ == "__main__":
    main()
