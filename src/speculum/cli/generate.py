"""``speculum generate``: one prompt's completion, streamed."""

from __future__ import annotations

import json
import sys

from ..errors import SpeculumError
from ..methods import METHODS
from .common import add_model_args, add_verify_args, load_for, sampling_params, verify_options


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt (streamed)",
                       description="Generate a completion, streaming tokens as they are accepted.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--method", default="auto",
                   help=f"decoding method: {', '.join(METHODS)} (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="(default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="also report each token's log-probability and its K most likely alternatives (0-20), "
                        "from the verification forward that accepted it (in --json's output, else one line per "
                        "token on stderr)")
    g.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                   help="raw: the model's distribution; processed: the one the token was chosen from (after "
                        "penalties, the grammar's mask, and when sampling temperature, top-k and top-p); "
                        "default: %(default)s")
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
    con.add_argument("--constraint-sampling", choices=("mask", "asap", "awrs"), default="mask",
                     help="how a sampled request (--temperature > 0) meets the constraint: mask (default: each "
                          "step samples the model restricted to legal tokens, which skews whole outputs), asap "
                          "(Grammar-Aligned Decoding: reweights by grammaticality learned over repeated samples "
                          "of the same prompt, exact as they accumulate) or awrs (adaptive weighted rejection "
                          "sampling over --particles runs, one resampled by its importance weight)")
    con.add_argument("--particles", type=int, default=8,
                     help="particles per request for --constraint-sampling awrs (default: 8)")
    kvg = g.add_argument_group("KV cache (long prompts)")
    kvg.add_argument("--kv-policy", default="full",
                     help="what the KV cache keeps and reads: full (default), streaming, h2o, keyformer, d2o, snapkv, "
                          "pyramidkv, cake, adakv, chelsea, duo, kv_quant, gear, zipcache, think, shadowkv, tidal, "
                          "quest, double_sparsity, tokenselect, squeezed, recycled, hip; options as name:key=value,... (see `speculum longctx --help`)")
    kvg.add_argument("--kv-budget", default="0.25",
                     help="KV budget: a token count (1024) or a ratio of the prompt (0.25; default)")
    kvg.add_argument("--kv-draft", default=None, metavar="SPEC",
                     help="lossless long context: keep the full cache to verify, and draft with the same model "
                          "reading a compressed view of it: streaming (attention sinks + recent window), snapkv (also the "
                          "entries the prompt's end attends to most), quest (also the key pages whose score bound is "
                          "highest for each draft forward), duo (DuoAttention's retrieval heads read everything, its "
                          "streaming heads sinks + window), tidal (TidalDecode: layers after a selection layer read "
                          "the entries it attends to most), tokenselect (each layer reads the entries its heads' soft "
                          "votes pick) or double_sparsity (entries picked by label channels' approximate attention), "
                          "with options sink=4, window=512 (the others 256; "
                          "duo: the gates' own, 64 and 256 for the shipped ones), selected=512, observe=32 (snapkv; "
                          "double_sparsity; tidal, tokenselect: selected), pages=32, page=16 (quest), gates=FILE|auto, retrieval=25 (duo: percent of "
                          "the gated heads that read everything), dense=2 (tidal, tokenselect), threshold=90 "
                          "(tokenselect: percent cosine similarity to reuse a vote), channels=head size/8 "
                          "(double_sparsity), bits=4|8|16 (an int4 (default) "
                          "or int8 weight copy drafts, 16 the "
                          "target's own weights), depth=6, top_k=1, trim=1 (0: the draft's head covers the whole "
                          "vocabulary), lookup=8 (tokens a chain found earlier in the text takes from there; 0: none); "
                          "e.g. snapkv:bits=8. Runs the kv_draft method in "
                          "place of --method")
    add_model_args(g)
    add_verify_args(g)


def _constraint(args):
    """The constraint ``generate`` was given (files read here; the rest is shared with the server)."""
    from pathlib import Path

    from ..constrain import pick_constraint

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


def run(args) -> int:
    from ..kv import make_policy
    from ..methods import build_method
    from ..prompts import encode_prompt
    from ..text_stream import StreamingText

    if args.max_new_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    sampling = sampling_params(args)
    spec = _constraint(args)
    if args.close_reserve < 0 or (args.close_reserve and spec is None):
        raise SpeculumError("--close-reserve takes a token count >= 0, with a constraint (--json-schema, ...)")
    if args.constraint_sampling != "mask" and spec is None:
        raise SpeculumError("--constraint-sampling takes a constraint (--json-schema, --regex, ...)")
    policy = make_policy(args.kv_policy, args.kv_budget)
    options = {"draft_head": args.draft_head}
    if args.kv_draft is not None:
        from ..drafters.kv_draft import kv_draft_options

        if policy is not None:
            raise SpeculumError("--kv-draft keeps the full cache to verify against: it takes no --kv-policy")
        options = kv_draft_options(args.kv_draft)
        args.method = "kv_draft"
    model, tok, draft, draft_tok = load_for(args, [args.method], args.prompt)
    method = build_method(args.method, model, tok, draft, draft_tok, kv_policy=policy, **options, **verify_options(args))
    grammar = method.compile(spec, args.close_reserve, args.constraint_sampling, args.particles) \
        if spec is not None else None
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
        for t in result.logprobs or []:
            alts = "  ".join(f"{tok.decode([i])!r} {lp:.3f}" for i, lp in t.top)
            lp = "-" if t.logprob is None else f"{t.logprob:.3f}"
            print(f"{tok.decode([t.token])!r}\t{lp}" + (f"\t{alts}" if alts else ""), file=sys.stderr)
        print(f"[{result.new_tokens} tokens, {result.tok_s:.1f} tok/s, {result.mean_accepted:.2f} tokens/step, "
              f"{result.finish_reason}]", file=sys.stderr)
    return 0
