"""``speculum`` command line: ``generate``, ``bench``, ``calibrate``, ``longctx``, ``serve``, ``train-draft``
and ``export-head``.

User mistakes (unknown model or method, bad parameters, empty prompt, ...) print one line
``speculum: error: ...`` and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .errors import SpeculumError
from .methods import ENGINE_METHODS, METHODS

DEFAULT_BENCH_METHODS = "hf,hf_pld,ar,ngram,suffix,auto"  # float weights: transformers' generate as the reference
DEFAULT_STRUCTURED_METHODS = "hf,ar,ngram,auto"
# quantized weights: llama.cpp on the same GGUF as the reference, where llama-cpp-python is installed
DEFAULT_QUANT_BENCH_METHODS = "ar,ngram,suffix,auto"
DEFAULT_QUANT_STRUCTURED_METHODS = "ar,ngram,auto"


def _add_runner_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=["auto", "native", "hf"], default="auto",
                   help="what runs the model's forwards for speculum's own methods: 'native' (speculum's "
                        "decoder for Llama-family and Gemma-3 models: static KV cache, CUDA graphs on GPU), "
                        "'hf' (transformers' modules, any causal LM) or 'auto' (native where supported; "
                        "default). The hf* baselines always run transformers' generate.")


DTYPE_HELP = ("the activations' dtype (and the weights' with --weights float): auto (default: float32 with "
              "quantized weights; else bfloat16 on a GPU or on a CPU with bfloat16 instructions, AVX-512 BF16 or "
              "AMX, float32 on other CPUs, where bfloat16 is emulated and slower), bfloat16, float32 or float16")
WEIGHTS_HELP = ("which weights the model runs: 'gguf' (a GGUF file's own quantization, on speculum's quantized "
                "kernels, which round the activations to 8 bits per block as llama.cpp does: the bytes and the "
                "arithmetic of llama.cpp), 'float' (dequantized to --dtype; what transformers and "
                "the hf methods run), 'int8' or 'int4' (a float model quantized at load time) or 'auto' "
                "(default: gguf for a GGUF file on a CPU, else float). Quantized weights are another model: "
                "speculative output equals that model's greedy output, not the float model's")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct, packaged), 'gemma3' (Gemma-3-270M base, packaged), "
                        "a .gguf file, a local Hugging Face directory or a hub id (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "float", "int8", "int4"],
                   help=WEIGHTS_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--draft-model", default=None,
                   help="draft model for the draft_model and hf_assisted methods (same tokenizer as --model)")
    p.add_argument("--draft-head", default=None, type=_head_files, metavar="FILE[,FILE...]",
                   help=HEAD_HELP)
    _add_runner_arg(p)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the tokenizer's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="feed the prompt as raw text")
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


HEAD_HELP = ("trained head files for the learned drafters (eagle, medusa, hydra, kangaroo, ppd), from `speculum train-draft`, "
             "comma-separated, each used for its kind (default: the heads speculum ships for --model, if any)")


def _head_files(text: str) -> tuple[str, ...]:
    """``--draft-head a.safetensors,b.safetensors`` -> the file names."""
    files = tuple(x.strip() for x in text.split(",") if x.strip())
    if not files:
        raise argparse.ArgumentTypeError("give at least one head file")
    return files


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculum",
        description="Lossless speculative decoding for Hugging Face causal LMs: same output as plain "
                    "decoding, fewer target forward passes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one prompt (streamed)",
                       description="Generate a completion, streaming tokens as they are accepted.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--method", default="auto",
                   help=f"decoding method: {', '.join(METHODS)} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="(default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, new_tokens, time_s, tok_s, mean_accepted, steps) instead")
    con = g.add_argument_group("structured output (at most one)")
    con.add_argument("--json-schema", metavar="FILE",
                     help="the output must be JSON valid under this schema, in OpenAI's strict mode: objects "
                          "take no keys beyond those they declare (unless the schema says otherwise)")
    con.add_argument("--json-object", action="store_true", help="the output must be a JSON object")
    con.add_argument("--regex", help="the output must match this regular expression")
    con.add_argument("--choice", help="the output must be one of these comma-separated strings")
    con.add_argument("--grammar", metavar="FILE", help="the output must match this Lark grammar")
    con.add_argument("--close-reserve", type=int, default=0, metavar="N",
                     help="the budget closer: each token among the last N of --max-new-tokens is kept only if "
                          "the grammar can still be completed in the budget after it; else the grammar's "
                          "shortest completion ends the output, valid (finish reason 'closed'; default: 0, off)")
    kvg = g.add_argument_group("KV cache (long prompts)")
    kvg.add_argument("--kv-policy", default="full",
                     help="what the KV cache keeps and reads: full (default), streaming, h2o, snapkv, kv_quant, "
                          "tidal, quest; options as name:key=value,... (see `speculum longctx --help`)")
    kvg.add_argument("--kv-budget", default="0.25",
                     help="KV budget: a token count (1024) or a ratio of the prompt (0.25; default)")
    kvg.add_argument("--kv-draft", default=None, metavar="SPEC",
                     help="lossless long context: keep the full cache to verify, and draft with the same model "
                          "reading a compressed view of it: streaming (attention sinks + recent window), snapkv (also the "
                          "entries the prompt's end attends to most) or quest (also the key pages whose score bound is "
                          "highest for each draft forward), with options sink=4, window=512 (snapkv and quest 256), "
                          "selected=512, observe=32 (snapkv), pages=32, page=16 (quest), bits=4|8|16 (an int4 (default) "
                          "or int8 weight copy drafts, 16 the "
                          "target's own weights), depth=6, top_k=1, trim=1 (0: the draft's head covers the whole "
                          "vocabulary), lookup=8 (tokens a chain found earlier in the text takes from there; 0: none); "
                          "e.g. snapkv:bits=8. Runs the kv_draft method in "
                          "place of --method")
    _add_model_args(g)

    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench-format prompts",
                       description="Run several methods on the same prompts, interleaved, after a warm-up; "
                                   "write results.json, results.md and speedup.png.")
    b.add_argument("--data", default=None,
                   help="Spec-Bench JSONL file (default: the small prompt set bundled with speculum)")
    b.add_argument("--per-task", type=int, default=None, help="first N prompts of each task (default: all)")
    b.add_argument("--max-new-tokens", "--max-tokens", type=int, default=None,
                   help="(default: 128; 64 for --workload serving)")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {', '.join(METHODS)} (default, quantized weights: "
                        f"{DEFAULT_QUANT_BENCH_METHODS}, plus llama_cpp,llama_cpp_lookup where llama-cpp-python "
                        f"is installed; with --weights float: {DEFAULT_BENCH_METHODS}; "
                        f"{DEFAULT_QUANT_STRUCTURED_METHODS} or {DEFAULT_STRUCTURED_METHODS} for --workload "
                        "structured)")
    b.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    b.add_argument("--workload", choices=["specbench", "repeated", "structured", "serving"], default="specbench",
                   help="specbench: each prompt of --data once (default); repeated: a bundled set of "
                        "code-editing and agent-style requests replayed --rounds times, reported per round; "
                        "structured: JSON schemas from --schemas, each method constrained and unconstrained; "
                        "serving: concurrent clients against a live server (speculum serve started here, or --url)")
    b.add_argument("--schemas", default=None,
                   help="JSONSchemaBench-format JSONL ({id, dataset, schema} per line) for --workload structured")
    b.add_argument("--n-schemas", type=int, default=30,
                   help="schemas to generate for (of those that compile; default: %(default)s)")
    b.add_argument("--close-reserve", type=int, default=0,
                   help="structured workload: the budget closer (0: off). Each token among the last N of the "
                        "budget is kept only if the grammar can still be completed in the budget after it; else "
                        "the grammar's shortest completion ends the output (finish reason 'closed'). N >= "
                        "--max-new-tokens checks every token (default: %(default)s)")
    b.add_argument("--rounds", type=int, default=3, help="rounds of the repeated workload (default: %(default)s)")
    sv = b.add_argument_group("serving workload")
    sv.add_argument("--concurrency", default="1,4,8,16",
                    help="comma-separated numbers of concurrent clients (default: %(default)s)")
    sv.add_argument("--requests", type=int, default=32, help="requests per concurrency level (default: %(default)s)")
    sv.add_argument("--url", default=None,
                    help="drive this OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1; --model is the model "
                         "name it serves) instead of starting speculum serve with --model, --dtype and the first "
                         "of --methods")
    sv.add_argument("--max-batch", type=int, default=None, help="speculum serve's --max-batch (default: its own)")
    sv.add_argument("--engines", type=int, default=None, help="speculum serve's --engines (default: its own)")
    sv.add_argument("--system-tokens", type=int, default=1000,
                    help="size of the shared system prompt of the prefix-reuse part (0: skip it; default: "
                         "%(default)s)")
    sv.add_argument("--tasks", default=None, metavar="T1,T2",
                    help="only these Spec-Bench tasks (mt_bench, translation, summarization, qa, math_reasoning, rag; "
                         "default: all)")
    sv.add_argument("--label", default=None, help="this run's name in the table (default: the server and method)")
    sv.add_argument("--include", default=None, metavar="DIR1,DIR2",
                    help="other serving runs' output folders (e.g. vLLM's, benchmarks/vllm_serving.py) to put in "
                         "the same table and plot")
    _add_model_args(b)

    c = sub.add_parser("calibrate", help="measure the forward cost curve that sizes draft trees",
                       description="Time one verification forward over 1..64 tree tokens at a few context "
                                   "lengths for each dtype, cache the curve (the tree sizer reads it), print "
                                   "it with the tree budget it implies, and plot it.")
    c.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    c.add_argument("--dtypes", default="auto,float32",
                   help="comma-separated dtypes to calibrate; auto is the one runs use by default (see "
                        "generate --dtype) (default: %(default)s)")
    c.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    c.add_argument("--runners", default="auto",
                   help="comma-separated runners to calibrate: auto, native, hf (default: %(default)s)")
    c.add_argument("--contexts", default=None,
                   help="comma-separated context lengths to time (default: 64,512,2048; the tree sizer reads "
                        "the default curve, so other lengths are for reports)")
    c.add_argument("--force", action="store_true", help="measure again even if a cached curve exists")
    c.add_argument("--out", default="calibration", help="directory for calibration.json/.md/.png "
                                                          "(default: %(default)s)")
    lc = sub.add_parser(
        "longctx", help="KV-cache policies on a RULER-style long-context suite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate RULER-style tasks offline (fixed seeds; filler haystacks, never downloaded) at the "
                    "given prompt lengths and run each sample under every KV policy and budget, plain greedy "
                    "decoding. Prints and writes a table of accuracy (RULER's string_match_all, in %) x policy x "
                    "budget x length with the KV bytes held, the peak resident memory of each run, and decode "
                    "tok/s: DIR/results.json, DIR/results.md, DIR/records.json (every output) and "
                    "DIR/accuracy.png (accuracy against KV bytes). To keep the process lean it caps oneDNN's "
                    "per-shape kernel cache at 16 (ONEDNN_PRIMITIVE_CACHE_CAPACITY; a value you set is kept).",
        epilog="policies (name or name:key=value,...):\n"
               "  full       whole cache, full attention (the baseline; always run first)\n"
               "  streaming  StreamingLLM: 4 attention sinks + recent window        (sinks=4)\n"
               "  h2o        H2O: heavy hitters by accumulated attention + recent  (recent_ratio=0.5)\n"
               "  snapkv     SnapKV: observation-window votes, pooled               (window=32, kernel=15)\n"
               "  kv_quant   KIVI: 2/4-bit keys per channel, values per token       (bits=4, group=32, "
               "residual=32)\n"
               "  tidal      TidalDecode: top-k tokens from selection layers        (layers=6+14, kernel=7)\n"
               "  quest      Quest: top pages by key-bound scores                   (page=16, dense=2)\n"
               "budgets: tokens (1024) or a ratio of the prompt (0.25): tokens kept (eviction) or read per "
               "step (tidal, quest); kv_quant ignores them.\n"
               "protocols: aware = the policy sees the question at prefill; agnostic = the context is "
               "compressed first, then the question is appended (kvpress's default).")
    lc.add_argument("--lengths", default="1024,2048,4096,8192",
                    help="prompt lengths in tokens, comma-separated; capped at the model's context minus "
                         "room for the answer (default: %(default)s)")
    lc.add_argument("--policies", default="full,streaming,h2o,snapkv,kv_quant,tidal,quest",
                    help="comma-separated policies (default: %(default)s)")
    lc.add_argument("--budget", default="0.25", help="comma-separated budgets (default: %(default)s)")
    lc.add_argument("--kv-draft", default="", metavar="SPEC[;SPEC...]",
                    help="lossless rows: the full cache verifies what the same model drafts reading a compressed "
                         "view of it; semicolon-separated specs, e.g. 'streaming;snapkv:selected=1024' (see generate --help "
                         "for the options). The '= full "
                         "%%' column counts outputs identical to the full cache's (default: none)")
    lc.add_argument("--reproducible", action="store_true",
                    help="run full and the --kv-draft rows in the reproducible mode (chains verified with numerics "
                         "independent of a step's size), so that bfloat16 outputs compare token for token; "
                         "slower verification (native runner only)")
    lc.add_argument("--tasks", default="niah_single,niah_multikey,passkey",
                    help="comma-separated from niah_single, niah_multikey, niah_multivalue, niah_multiquery, "
                         "passkey, variable_tracking, common_words (default: %(default)s)")
    lc.add_argument("--samples", type=int, default=2, help="samples per task and length (default: %(default)s)")
    lc.add_argument("--values", default="number",
                    help="needle value kinds the samples cycle through: number, word, uuid (RULER's niah "
                         "variants; default: %(default)s)")
    lc.add_argument("--protocol", default="aware", choices=["aware", "agnostic"],
                    help="when the policy compresses: with the question (aware) or before it (agnostic)")
    lc.add_argument("--out", default="longctx-out", help="output directory (default: %(default)s)")
    lc.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    lc.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    lc.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    chat_lc = lc.add_mutually_exclusive_group()
    chat_lc.add_argument("--chat", dest="chat", action="store_true", default=None,
                         help="apply the tokenizer's chat template (default when it has one)")
    chat_lc.add_argument("--no-chat", dest="chat", action="store_false", help="raw text prompts")

    t = sub.add_parser(
        "train-draft", help="train a learned draft head for a model by self-distillation",
        description="Train a draft head (--kind) for --model. The model first answers the project's own "
                    "training prompts (templates over chat, writing, translation, summaries, questions, maths, "
                    "code and retrieval; text from Python's standard library; questions the model writes "
                    "itself; never Spec-Bench's), keeping its hidden states; then the head learns to predict "
                    "them. Every stage resumes from --out when interrupted. Writes OUT/<kind>.safetensors "
                    "(load it with --draft-head), report.json and loss.png (losses, held-out top-1 accuracy "
                    "by draft depth).")
    t.add_argument("--kind", default="eagle", choices=["eagle", "medusa", "hydra", "kangaroo", "ppd"],
                   help="the head to train (default: %(default)s); kinds trained into one --out share its data")
    t.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    t.add_argument("--out", required=True, help="directory for data, checkpoints, the head and its report")
    t.add_argument("--prompts", type=int, default=1600, help="training prompts (default: %(default)s)")
    t.add_argument("--self-prompts", type=int, default=160,
                   help="of --prompts, how many the model writes itself (default: %(default)s)")
    t.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default: %(default)s)")
    t.add_argument("--batch", type=int, default=16, help="requests answered at once (default: %(default)s)")
    t.add_argument("--dtype", default="auto", help="the model's dtype while it answers: " + DTYPE_HELP)
    t.add_argument("--epochs", type=int, default=None, help="passes over the data (default: eagle 10, medusa and hydra 4, kangaroo 5, ppd 1)")
    t.add_argument("--vocab", type=int, default=None,
                   help="draft vocabulary: the N most frequent response tokens (FR-Spec); 0 = the whole "
                        "vocabulary (default: 8192; ppd drafts through the target's own LM head: 0)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 1e-3; ppd 1e-2)")
    t.add_argument("--unroll", type=int, default=2,
                   help="training passes on the head's own predicted features (default: %(default)s)")
    t.add_argument("--heads", type=int, default=None,
                   help="medusa / hydra: heads, ppd: prompt tokens, i.e. the draft depth (default: 4; ppd 3)")
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
    x = sub.add_parser("export-head", help="write a trained head in the layout vLLM loads",
                       description="Write a head from `speculum train-draft` as a vLLM draft model directory: "
                                   "--format eagle (vLLM's EagleLlamaForCausalLM; the head must have been trained "
                                   "with --layout eagle1) or medusa (vLLM's MedusaModel). Serve it with vLLM's "
                                   "--speculative-config '{\"method\": \"eagle\", \"model\": \"OUT\", "
                                   "\"num_speculative_tokens\": 4}' (README, \"vLLM\").")
    x.add_argument("head", help="the head file (.safetensors from train-draft)")
    x.add_argument("--format", required=True, choices=["eagle", "medusa"], help="vLLM's layout to write")
    x.add_argument("--model", default="default", help="the head's target, as for generate (default: %(default)s)")
    x.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors)")
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/models, /v1/completions and /v1/chat/completions (streaming, "
                                   "response_format json_object / json_schema, sampling parameters), /health "
                                   "and Prometheus /metrics. Up to --max-batch requests decode together, one "
                                   "forward per step, each with its own drafter (pick one per request with "
                                   "extra_body={'speculum': {'method': 'ngram'}}); prompts sharing a prefix "
                                   "reuse its KV entries.")
    s.add_argument("--model", default="default", help="as for generate (default: %(default)s)")
    s.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    s.add_argument("--weights", default="auto", choices=["auto", "gguf", "float", "int8", "int4"],
                   help=WEIGHTS_HELP)
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    s.add_argument("--method", default="auto", help=f"default drafter: {', '.join(ENGINE_METHODS[:-1])} "
                                                     "(default: %(default)s)")
    s.add_argument("--draft-head", default=None, type=_head_files, metavar="FILE[,FILE...]", help=HEAD_HELP)
    s.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests allowed to wait while every engine runs --max-batch; more get HTTP 429 "
                        "(default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests each engine decodes together, one forward per step (continuous batching); "
                        "default: from the "
                        "calibration, the most sequences whose forward costs at most 3x one sequence's (16 on a "
                        "2-core AVX-512 CPU in bfloat16); 1 decodes one request at a time")
    s.add_argument("--engines", type=int, default=None,
                   help="processes that run the model, each with its own copy of the weights and its own batch "
                        "(requests go to the least busy one); default: 2 on a CPU with at least 2 cores, else 1. "
                        "Fewer start if memory would not hold the copies. 1 runs the model inside the HTTP process")
    s.add_argument("--replicas", type=int, default=None,
                   help="run N copies of this server as Ray Serve replicas behind Ray's HTTP proxy and router (same "
                        "API, limits and keys; needs `pip install 'speculum[ray]'`); each replica runs one engine "
                        "with the cores shared out, unless --engines/--threads say otherwise (default: no Ray)")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster ('auto' for the one `ray start` runs here, or "
                        "ray://HEAD:10001) so that replicas spread over its nodes; default: a Ray instance "
                        "started on this machine")
    s.add_argument("--threads", type=int, default=None,
                   help="CPU threads for each engine's kernels; default: with several engines, the cores shared out "
                        "among them; with one, all cores but one, which is left to the HTTP side (kernels on "
                        "several threads stall whenever another process takes one of their cores: BENCHMARKS.md)")
    s.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="MiB of recent prompts' KV entries kept so that a prompt starting the same way (a system "
                        "prompt) skips their prefill; per tenant; 0 turns it off (default: %(default)s)")
    s.add_argument("--max-tree", type=int, default=64, help="most drafted tokens per step (default: %(default)s)")
    s.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="reproducible output: the same temperature-0 or seeded request gives the same text every "
                        "time, in bfloat16 too, whatever the drafters learnt from other requests (verification "
                        "kernels whose rows do not depend on the draft's length, and chain drafts only). Default: "
                        "on where this costs little (the native runner, with kernels that have row floors, as "
                        "oneDNN's bfloat16 ones), else off; --deterministic forces it (padding every step where "
                        "the kernels need it: slow), --no-deterministic verifies whole draft trees")
    _add_runner_arg(s)
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model argument)")
    sec = s.add_argument_group("access")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1 routes (401 otherwise); repeat for several "
                          "keys, each its own tenant; also read from SPECULUM_API_KEY (comma-separated)")
    sec.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                     help="Host header names answered besides the bound address and localhost (DNS-rebinding "
                          "guard; '*' for any; default: any when --host is 0.0.0.0 or ::)")
    sec.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                     help="web origins (e.g. https://app.example) allowed to call the API from a browser (CORS); "
                          "default: none")
    sec.add_argument("--share-drafter-state", action="store_true",
                     help="let every request use what drafters learnt from all others (default: per tenant, "
                          "i.e. per API key and cache_salt)")
    sec.add_argument("--no-access-log", action="store_true", help="do not log a line per request on stderr")
    lim = s.add_argument_group("limits (each breach is a 4xx naming the flag)")
    lim.add_argument("--max-request-bytes", type=int, default=4 << 20,
                     help="largest request body (413 beyond; default: %(default)s)")
    lim.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt, in tokens, after the chat template (default: the model's context)")
    lim.add_argument("--max-json-depth", type=int, default=64,
                     help="deepest nesting of a request body, schemas included (default: %(default)s)")
    lim.add_argument("--max-grammar-bytes", type=int, default=64 << 10,
                     help="largest regex, grammar, JSON schema or choice list (default: %(default)s)")
    lim.add_argument("--grammar-timeout", type=float, default=10.0,
                     help="seconds a constraint may take to compile (default: %(default)s)")
    return parser


def _constraint(args):
    """The constraint ``generate`` was given (files read here; the rest is shared with the server)."""
    from pathlib import Path

    from .constrain import pick_constraint

    def read(path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise SpeculumError(f"{path} is not a file")
        return None if path is None else Path(path).read_text()

    choice = None if args.choice is None else [c.strip() for c in args.choice.split(",") if c.strip()]
    schema = read(args.json_schema)
    if schema is not None:
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpeculumError(f"{args.json_schema} is not valid JSON: {e}") from None
    spec = pick_constraint(json_schema=schema, json_object=args.json_object, regex=args.regex, choice=choice,
                           grammar=read(args.grammar),
                           names="--json-schema, --json-object, --regex, --choice, --grammar")
    if spec is not None:
        spec.grammar()  # a malformed constraint fails now, before any weights load
    return spec


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                          args.frequency_penalty, args.presence_penalty)


def _load(args, methods: list[str], prompt: str | None = None):
    from .methods import load_checked

    return load_checked(args.model, methods, args.draft_model, args.dtype, args.device, args.runner, prompt,
                        args.chat, weights=args.weights)


def cmd_generate(args) -> int:
    from .kv import make_policy
    from .methods import build_method
    from .prompts import encode_prompt
    from .text_stream import StreamingText

    if args.method not in METHODS:
        raise SpeculumError(f"unknown method {args.method!r}; choose from {', '.join(METHODS)}")
    if args.max_new_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    sampling = _sampling(args)
    spec = _constraint(args)
    if args.close_reserve < 0 or (args.close_reserve and spec is None):
        raise SpeculumError("--close-reserve takes a token count >= 0, with a constraint (--json-schema, ...)")
    policy = make_policy(args.kv_policy, args.kv_budget)
    options = {"draft_head": args.draft_head}
    if args.kv_draft is not None:
        from .drafters.kv_draft import kv_draft_options

        if policy is not None:
            raise SpeculumError("--kv-draft keeps the full cache to verify against: it takes no --kv-policy")
        options = kv_draft_options(args.kv_draft)
        args.method = "kv_draft"
    model, tok, draft, draft_tok = _load(args, [args.method], args.prompt)
    method = build_method(args.method, model, tok, draft, draft_tok, kv_policy=policy, **options)
    grammar = method.compile(spec, args.close_reserve) if spec is not None else None
    ids = encode_prompt(tok, args.prompt, args.chat)
    text = StreamingText(tok, args.stop)

    def stream(chunk: list[int]) -> None:
        delta = text.add(chunk)
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    result = method.run(ids, args.max_new_tokens, sampling, args.stop, args.seed,
                        None if args.json else stream, grammar=grammar)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        sys.stdout.write(text.finish(result.text) + "\n")
        print(f"[{result.new_tokens} tokens, {result.tok_s:.1f} tok/s, {result.mean_accepted:.2f} tokens/step, "
              f"{result.finish_reason}]", file=sys.stderr)
    return 0


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "command")}


def _default_bench_methods(args) -> str:
    """The methods ``bench`` compares when none are named: with float weights transformers' generate
    is the reference; with quantized ones (which it cannot run) llama.cpp greedy and prompt lookup on
    the same GGUF file, where llama-cpp-python is installed (``make llama``)."""
    import importlib.util

    from .loading import resolve_weights

    structured = args.workload == "structured"
    if resolve_weights(args.model, args.weights, args.device) == "float":
        return DEFAULT_STRUCTURED_METHODS if structured else DEFAULT_BENCH_METHODS
    methods = DEFAULT_QUANT_STRUCTURED_METHODS if structured else DEFAULT_QUANT_BENCH_METHODS
    if not structured and importlib.util.find_spec("llama_cpp") is not None:
        methods += ",llama_cpp,llama_cpp_lookup"
    return methods


def cmd_bench(args) -> int:
    from .bench.data import demo_prompts_path, load_prompts, repeated_prompts_path, repeated_workload
    from .bench.harness import bench_meta, run_benchmark, write_outputs
    from .bench.report import markdown_table
    from .models import parse_dtype

    if args.workload == "serving":
        return _bench_serving(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    if args.methods is None:
        args.methods = _default_bench_methods(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SpeculumError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise SpeculumError("--methods lists a method twice")
    if args.max_new_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    parse_dtype(args.dtype)
    sampling = _sampling(args)
    if args.workload == "structured":
        from .bench.structured import bench_structured, check_settings

        cases = check_settings(args.schemas, args.n_schemas, methods, args.temperature, args.close_reserve)
        model, tok, _, _ = _load(args, methods)
        text, out = bench_structured(model, tok, cases, methods, args.n_schemas, args.max_new_tokens, args.chat,
                                     not args.no_progress, args.close_reserve,
                                     bench_meta(model, _settings(args)), args.out)
        print(text)
        print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'per_schema.jsonl'}")
        return 0
    if args.workload == "repeated":
        prompts = repeated_workload(load_prompts(args.data or repeated_prompts_path(), args.per_task), args.rounds)
    else:
        prompts = load_prompts(args.data or demo_prompts_path(), args.per_task)
    prompts = _only_tasks(prompts, args.tasks)
    model, tok, draft, draft_tok = _load(args, methods)
    results, records = run_benchmark(model, tok, prompts, methods, args.max_new_tokens, sampling, args.chat,
                                     draft, draft_tok, seed=args.seed or 0, progress=not args.no_progress,
                                     method_options={m: {"draft_head": args.draft_head} for m in methods
                                                     if args.draft_head})
    meta = bench_meta(model, _settings(args))
    out = write_outputs(args.out, results, records, meta)
    print(markdown_table({**meta, **results}))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}")
    return 0


def _only_tasks(prompts: list, tasks: str | None) -> list:
    """The prompts of the comma-separated Spec-Bench ``tasks`` (all of them when ``tasks`` is None)."""
    if not tasks:
        return prompts
    wanted = {t.strip() for t in tasks.split(",") if t.strip()}
    kept = [p for p in prompts if p.task in wanted]
    if not kept:
        raise SpeculumError(f"no prompt of --tasks {tasks} in the data")
    return kept


def _bench_serving(args) -> int:
    """``bench --workload serving``: see :mod:`speculum.bench.serving`."""
    import torch

    from .bench.data import demo_prompts_path, load_prompts
    from .bench.harness import machine_info, versions
    from .bench.serving import LocalServer, run_serving, write_serving

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise SpeculumError("--concurrency takes comma-separated integers, e.g. 1,4,8,16") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise SpeculumError("--concurrency levels must lie in 1..256")
    if args.requests < 1:
        raise SpeculumError("--requests must be at least 1")
    max_tokens = args.max_new_tokens or 64
    if max_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    if args.system_tokens < 0:
        raise SpeculumError("--system-tokens must be >= 0")
    method = (args.methods or "auto").split(",")[0].strip()
    if args.url is None and method not in ENGINE_METHODS:
        raise SpeculumError(f"the serving workload serves one engine method; choose from {', '.join(ENGINE_METHODS)}")
    prompts = _only_tasks(load_prompts(args.data or demo_prompts_path(), args.per_task), args.tasks)
    include = [x.strip() for x in (args.include or "").split(",") if x.strip()]
    meta = {"machine": machine_info(torch.device("cpu")), "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "settings": {"concurrency": levels, "requests": args.requests, "max_tokens": max_tokens,
                         "model": args.model, "dtype": args.dtype, "method": method, "url": args.url,
                         "max_batch": args.max_batch, "engines": args.engines, "system_tokens": args.system_tokens,
                         "tasks": args.tasks}}
    if args.url is not None:
        label = args.label or args.url
        run = run_serving(args.url, args.model, prompts, levels, args.requests, max_tokens, args.system_tokens,
                          progress=not args.no_progress)
    else:
        serve = ["--model", args.model, "--dtype", args.dtype, "--method", method,
                 "--max-queue", str(max(levels) * 2)]
        if args.max_batch is not None:
            serve += ["--max-batch", str(args.max_batch)]
        if args.engines is not None:
            serve += ["--engines", str(args.engines)]
        label = args.label or f"speculum {method}" + "".join(
            f" ({flag} {value})" for flag, value in (("max-batch", args.max_batch), ("engines", args.engines)) if value)
        with LocalServer(serve) as server:
            run = run_serving(server.url, args.model, prompts, levels, args.requests, max_tokens,
                              args.system_tokens, progress=not args.no_progress)
    text, out = write_serving(args.out, label, run, meta, include)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'serving.png'}")
    return 0


def cmd_calibrate(args) -> int:
    from .calibrate import CONTEXTS, load_or_measure, write_report
    from .loading import load
    from .models import dtype_name, parse_dtype
    from .runners import RUNNER_KINDS, runner_for

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    kinds = [k.strip() for k in args.runners.split(",") if k.strip()]
    if not dtypes:
        raise SpeculumError("--dtypes is empty")
    if not kinds or any(k not in RUNNER_KINDS for k in kinds):
        raise SpeculumError(f"--runners takes a comma-separated list of {', '.join(RUNNER_KINDS)}")
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()] if args.contexts else CONTEXTS
    except ValueError:
        raise SpeculumError("--contexts takes comma-separated token counts, e.g. 64,512") from None
    if not contexts or min(contexts) < 1:
        raise SpeculumError("--contexts takes positive token counts")
    dtypes = list(dict.fromkeys(dtype_name(parse_dtype(d, args.device)) for d in dtypes))  # auto: its name
    curves, labels = {}, {}
    for d in dtypes:
        model, _ = load(args.model, d, args.device)
        for kind in kinds:
            runner = runner_for(model, kind)
            label = d if len(kinds) == 1 else f"{d} {type(runner).__name__}"
            curves[label] = load_or_measure(runner, progress=True, force=args.force, contexts=contexts)
            labels[label] = type(runner).__name__
        del model, runner
    text, out = write_report(args.out, curves, labels)
    print(text)
    print(f"wrote {out / 'calibration.json'}, {out / 'calibration.md'}, {out / 'calibration.png'}")
    return 0


def cmd_longctx(args) -> int:
    import shlex

    import torch

    from .bench.longctx import ONEDNN_CACHE, Suite, markdown, run_longctx, write_outputs
    from .drafters.kv_draft import kv_draft_options
    from .loading import load
    from .models import dtype_name
    from .runners import release_if_native

    suite = Suite.parse(args.lengths, args.tasks, args.policies, args.budget, args.samples, args.values)
    kv_drafts = tuple(x.strip() for x in args.kv_draft.split(";") if x.strip())
    for spec in kv_drafts:
        kv_draft_options(spec)  # a bad spec fails before the model loads
    # read when oneDNN compiles its first kernel, so before the model loads; a value set by the user is kept
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
    model, tok = load(args.model, args.dtype, args.device)
    release_if_native(model)  # the suite runs nothing else
    records = run_longctx(model, tok, suite.lengths, suite.tasks, suite.policies, suite.budgets, suite.samples,
                          args.protocol, args.chat, values=tuple(suite.values), kv_drafts=kv_drafts,
                          reproducible=args.reproducible)
    meta = {"command": "speculum " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "model": args.model,
            "values": suite.values, "dtype": dtype_name(next(model.parameters()).dtype), "protocol": args.protocol,
            "threads": torch.get_num_threads(),
            "onednn_primitive_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    rows = write_outputs(args.out, records, meta)
    print(markdown(rows))
    print(f"wrote {args.out}/results.json, results.md, records.json, accuracy.png")
    return 0


def cmd_serve(args) -> int:
    from .server.launch import build_guard, build_state, check_serve_args, serve_http

    check_serve_args(args)
    guard, origins = build_guard(args)
    if args.replicas is not None or args.ray_address:
        from .integrations.ray_serve import serve_replicas

        return serve_replicas(args, guard, origins)
    state = build_state(args)
    serve_http(state, guard, origins, args)
    return 0


def cmd_export_head(args) -> int:
    from .heads.export import export_eagle, export_medusa
    from .loading import load
    from .models import load_tokenizer_and_config

    if args.format == "eagle":
        _, config = load_tokenizer_and_config(args.model)
        out = export_eagle(args.head, config, args.out)
    else:
        target, _ = load(args.model, "bfloat16", weights="float")  # vLLM runs the float model
        out = export_medusa(args.head, target, args.out)
    print(f"wrote {out} (vLLM: --speculative-config '{{\"method\": \"{args.format}\", \"model\": \"{out}\", "
          f"\"num_speculative_tokens\": 4}}')")
    return 0


def cmd_train_draft(args) -> int:
    from .train import DraftTraining, train_draft

    job = DraftTraining.for_kind(args.kind, model=args.model, out=args.out, prompts=args.prompts,
                                 self_prompts=min(args.self_prompts, args.prompts // 2),
                                 max_new_tokens=args.max_new_tokens, batch=args.batch, dtype=args.dtype,
                                 epochs=args.epochs, vocab=args.vocab, lr=args.lr, unroll=args.unroll,
                                 heads=args.heads, exit_layer=args.exit_layer, ensemble=args.ensemble,
                                 max_samples=args.max_samples, layout=args.layout, seed=args.seed)
    summary = train_draft(job, progress=not args.no_progress)
    depths = ", ".join(f"{a:.3f}" for a in summary["top1_by_depth"])
    print(f"wrote {summary['head']} ({summary['samples']} samples, {summary['tokens']} response tokens, "
          f"{summary['total_seconds']} s); held-out top-1 by depth: {depths}")
    print(f"report: {summary['report']}, {summary['plot']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="speculum: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        handler = {"generate": cmd_generate, "bench": cmd_bench, "calibrate": cmd_calibrate,
                   "longctx": cmd_longctx, "serve": cmd_serve, "train-draft": cmd_train_draft,
                   "export-head": cmd_export_head}[args.command]
        return handler(args)
    except SpeculumError as e:
        print(f"speculum: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speculum: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
