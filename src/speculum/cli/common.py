"""What the subcommands share: the model and runner options, sampling, loading."""

from __future__ import annotations

import argparse

from ..errors import SpeculumError


def add_runner_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=["auto", "native", "hf"], default="auto",
                   help="what runs the model's forwards for speculum's own methods: 'native' (speculum's "
                        "decoder for Llama-family and Gemma-3 models: static KV cache, CUDA graphs on GPU), "
                        "'hf' (transformers' modules, any causal LM) or 'auto' (native where supported; "
                        "default). The hf* baselines always run transformers' generate.")


def add_chat_args(p: argparse.ArgumentParser, raw_help: str = "feed the prompt as raw text") -> None:
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the tokenizer's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help=raw_help)


DTYPE_HELP = ("the activations' dtype (and the weights' with --weights float): auto (default: float32 with "
              "quantized weights; else bfloat16 on a GPU or on a CPU with bfloat16 instructions, AVX-512 BF16 or "
              "AMX, float32 on other CPUs, where bfloat16 is emulated and slower), bfloat16, float32 or float16")
MODEL_HELP = ("'default' (SmolLM2-135M-Instruct, packaged), 'gemma3' (Gemma-3-270M base, packaged), "
              "a .gguf file, a local Hugging Face directory or a hub id (default: %(default)s)")
WEIGHTS_HELP = ("which weights the model runs: 'gguf' (a GGUF file's own quantization, on speculum's quantized "
                "kernels, which round the activations to 8 bits per block as llama.cpp does: the bytes and the "
                "arithmetic of llama.cpp), 'float' (dequantized to --dtype; what transformers and "
                "the hf methods run), 'int8' or 'int4' (a float model quantized at load time) or 'auto' "
                "(default: gguf for a GGUF file on a CPU, else float). Quantized weights are another model: "
                "speculative output equals that model's greedy output, not the float model's")


def add_load_args(p: argparse.ArgumentParser, model_help: str = MODEL_HELP) -> None:
    """--model, --dtype, --weights and --device: the model and how it loads."""
    p.add_argument("--model", default="default", help=model_help)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "float", "int8", "int4"],
                   help=WEIGHTS_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p)
    p.add_argument("--draft-model", default=None,
                   help="draft model for the draft_model methods (same tokenizer as --model), cross_vocab and "
                        "hf_assisted (any tokenizer)")
    p.add_argument("--draft-head", default=None, type=head_files, metavar=HEAD_METAVAR, help=HEAD_HELP)
    add_runner_arg(p)
    add_chat_args(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens already in the prompt or "
                        "output by this (transformers' and vLLM's; default 1.0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the output from its logit (OpenAI's, -2..2; "
                        "default 0 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token already in the output (OpenAI's, -2..2; "
                        "default 0 = off)")


def add_verify_args(p: argparse.ArgumentParser) -> None:
    """``--verify`` (the exact rule for sampled multi-draft trees) and ``--judge`` (lossy judge decoding)."""
    from ..verify.rules import DEFAULT_RULE, VERIFY_RULES

    g = p.add_argument_group("verification")
    g.add_argument("--verify", default=DEFAULT_RULE, choices=list(VERIFY_RULES),
                   help="exact rule for sampled trees with several drafts per node: specinfer (i.i.d. drafts, "
                        "sequential rejection), rsd (Recursive Speculative Decoding: drafts without replacement), "
                        "spectr (SpecTr's K-SEQ over i.i.d. drafts); greedy output is the same under all "
                        "(default: %(default)s)")
    g.add_argument("--judge", default=None, metavar="FILE",
                   help="LOSSY judge decoding (Bachmann et al. 2025): a linear judge head (speculum.train.judge) "
                        "also accepts drafted tokens the target did not choose; greedy output then differs "
                        "from plain decoding's; off by default")
    g.add_argument("--judge-threshold", type=float, default=None, metavar="P",
                   help="accept a drafted token whose judge score exceeds P (default: the head's own)")


def verify_options(args) -> dict:
    """build_method's options for ``--verify`` / ``--judge``."""
    options = {"verify": args.verify}
    if args.judge is not None:
        options.update(judge=args.judge, judge_threshold=args.judge_threshold)
    elif args.judge_threshold is not None:
        raise SpeculumError("--judge-threshold needs --judge")
    return options


HEAD_HELP = ("draft heads for the learned drafters, comma-separated, each used for its kind: head files from "
             "`speculum train-draft` (eagle, medusa, hydra, kangaroo, ppd), or published heads in their released "
             "layouts, as a directory or a Hugging Face hub id (downloaded): EAGLE-1/2 and EAGLE-3 (for eagle), "
             "Medusa (for medusa); default: the heads speculum ships for --model, if any")
HEAD_METAVAR = "FILE|DIR|HUB_ID[,...]"


def head_files(text: str) -> tuple[str, ...]:
    """``--draft-head a.safetensors,yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` -> the files, directories or hub ids."""
    files = tuple(x.strip() for x in text.split(",") if x.strip())
    if not files:
        raise argparse.ArgumentTypeError("give at least one head file, directory or hub id")
    return files


def sampling_params(args):
    from ..sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                          args.frequency_penalty, args.presence_penalty, getattr(args, "logprobs", None),
                          getattr(args, "logprobs_mode", "raw"))


def load_for(args, methods: list[str], prompt: str | None = None):
    from ..methods import load_checked

    return load_checked(args.model, methods, args.draft_model, args.dtype, args.device, args.runner, prompt,
                        args.chat, weights=args.weights)
