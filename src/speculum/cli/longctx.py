"""``speculum longctx``: KV-cache policies on a RULER-style long-context suite."""

from __future__ import annotations

import argparse
import os
import sys

from .common import DTYPE_HELP, add_chat_args


def add_parser(sub) -> None:
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
               "  full             whole cache, full attention (the baseline; always run first)\n"
               "  streaming        StreamingLLM: 4 attention sinks + recent window        (sinks=4)\n"
               "  h2o              H2O: heavy hitters by accumulated attention + recent  (recent_ratio=0.5)\n"
               "  snapkv           SnapKV: observation-window votes, pooled               (window=32, kernel=15)\n"
               "  kv_quant         KIVI: 2/4-bit keys per channel, values per token       (bits=4, group=32, "
               "residual=32)\n"
               "  tidal            TidalDecode: top-k tokens from selection layers        (layers=6+14, kernel=7)\n"
               "  quest            Quest: top pages by key-bound scores                   (page=16, dense=2)\n"
               "  think            ThinK: prompt keys keep the channels queries weigh     (prune=0.4, recent=32, snapkv=0)\n"
               "  gear             GEAR: KIVI + low-rank residual + exact outliers        (bits=4, rank=4, sparsity=0.02)\n"
               "  zipcache         ZipCache: salient tokens 4-bit, the others 2-bit       (ratio=0.4, probes=0.1)\n"
               "  shadowkv         ShadowKV: low-rank pre-RoPE keys, landmark-chosen chunks (rank=64, outliers=48)\n"
               "  keyformer        Keyformer: key tokens by accumulated Gumbel-softmax scores + recent window (evicts)\n"
               "  d2o              D2O: H2O's eviction, each evicted token merged into its most similar kept one (evicts)\n"
               "  pyramidkv        PyramidKV: SnapKV's votes, per-layer budgets falling linearly with depth (evicts at prefill)\n"
               "  cake             CAKE: per-layer budgets by attention dispersion, split in cascade as layers prefill (evicts at prefill)\n"
               "  adakv            Ada-KV: SnapKV's votes, a layer's budget split over its KV heads by joint top-k (evicts at prefill)\n"
               "  chelsea          Chelsea: the prompt's chunks clustered, one merged entry per cluster (merges at prefill)\n"
               "  duo              DuoAttention: learned gates; retrieval heads keep all, streaming heads sinks + window\n"
               "  double_sparsity  Double Sparsity: top-k tokens by label-channel scores (a small label cache)\n"
               "  tokenselect      TokenSelect: top-k tokens by head-soft-voted q.k, Selection Cache reuse\n"
               "  squeezed         Squeezed Attention: prompt keys clustered at prefill, the matching clusters read\n"
               "  recycled         Recycled Attention: full attention every stride positions, its top-k recycled in between\n"
               "  hip              HiP: hierarchical top-k over key blocks judged by representative keys\n"
               "  (every policy's rule, paper and options: docs/long-context.md)\n"
               "budgets: tokens (1024) or a ratio of the prompt (0.25): tokens kept (eviction) or read per "
               "step (the sparse-read policies, shadowkv); kv_quant, gear, zipcache and think (without snapkv=1) ignore them.\n"
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
                         "view of it (streaming, snapkv, quest, duo, tidal, tokenselect, double_sparsity); semicolon-separated specs, e.g. "
                         "'streaming;snapkv:selected=1024;duo' (see generate --help for the options). The '= full "
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
    add_chat_args(lc, "raw text prompts")


def run(args) -> int:
    import shlex

    import torch

    from ..bench.longctx import ONEDNN_CACHE, Suite, markdown, run_longctx, write_outputs
    from ..drafters.kv_draft import kv_draft_options
    from ..loading import load
    from ..models import dtype_name
    from ..runners import release_if_native

    suite = Suite.parse(args.lengths, args.tasks, args.policies, args.budget, args.samples, args.values)
    kv_drafts = tuple(x.strip() for x in args.kv_draft.split(";") if x.strip())
    for spec in kv_drafts:
        kv_draft_options(spec)  # a bad spec fails before the model loads
    # read when oneDNN compiles its first kernel, so before the model loads; a value set by the user is kept
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
    model, tok = load(args.model, args.dtype, args.device)
    release_if_native(model)  # the suite runs nothing else
    records = run_longctx(model, tok, suite, args.protocol, args.chat, kv_drafts=kv_drafts,
                          reproducible=args.reproducible)
    meta = {"command": "speculum " + " ".join(shlex.quote(a) for a in sys.argv[1:]), "model": args.model,
            "values": suite.values, "dtype": dtype_name(next(model.parameters()).dtype), "protocol": args.protocol,
            "threads": torch.get_num_threads(),
            "onednn_primitive_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    rows = write_outputs(args.out, records, meta)
    print(markdown(rows))
    print(f"wrote {args.out}/results.json, results.md, records.json, accuracy.png")
    return 0
