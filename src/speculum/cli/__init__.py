"""``speculum`` command line: ``generate``, ``bench``, ``calibrate``, ``longctx``, ``serve``, ``train-draft``,
``train-duo`` and ``export-head``.

User mistakes (unknown model or method, bad parameters, empty prompt, ...) print one line
``speculum: error: ...`` and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import SpeculumError
from . import bench, calibrate, export_head, generate, longctx, serve, train_draft, train_duo

# subcommand name -> its module (``add_parser(sub)`` and ``run(args) -> exit status``), in --help's order
COMMANDS = {"generate": generate, "bench": bench, "calibrate": calibrate, "longctx": longctx,
            "train-draft": train_draft, "train-duo": train_duo, "export-head": export_head, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculum",
        description="Lossless speculative decoding for Hugging Face causal LMs: same output as plain "
                    "decoding, fewer target forward passes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="speculum: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return COMMANDS[args.command].run(args)
    except SpeculumError as e:
        print(f"speculum: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speculum: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
