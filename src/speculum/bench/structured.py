"""Structured-output benchmark: real JSON schemas, constrained against unconstrained decoding.

Data: JSONSchemaBench-format JSONL (``{"id", "dataset", "schema"}`` per line). Every schema is
first compiled (coverage: how many the grammar engine accepts, and why the others are refused;
a refused schema is reported, never replaced by a looser one). Of the compiled ones, ``count``
are taken, spread evenly over the file, and each is asked for with a prompt that shows the schema.

For each schema and method (in an order rotating from schema to schema, after a warm-up), the
method runs twice: constrained by the schema (OpenAI's ``strict`` mode: objects take no keys
beyond those they declare) and unconstrained. Reported per method:

- ``valid``: constrained outputs that ended by themselves (or, with ``close_reserve``, were ended by
  the grammar's budget closer: ``closed``) and validate against the *original* schema with
  ``jsonschema`` (``valid_unconstrained`` for comparison);
- ``finished`` / ``closed``: constrained outputs that ended by themselves / by the budget closer;
- ``decode_tok_s`` constrained and unconstrained (all generated tokens over all decoding time, the
  prompt's prefill left out) and their ratio ``decode_ratio``: the rate at which each mode emits
  tokens. Both modes prefill the same prompt, while the constrained output is often far shorter
  (a 5-token JSON object against 256 tokens of prose), so a rate with prefill included mostly
  measures how long the answers are;
- ``tok_s`` constrained and unconstrained (mean over schemas of tokens / time, prefill included)
  and their ratio, for comparison, and ``overall_ratio``: all tokens over all time, prefill included;
- ``speedup_vs_hf``: constrained tok/s over ``hf``'s constrained tok/s (transformers ``generate``
  with the same grammar as a logits processor);
- ``mask_us_per_token``: grammar time (tree pruning, masks, forced tokens) per generated token;
- ``forced_frac``: generated tokens that the grammar forced (drafted for free);
- ``mean_accepted``: generated tokens per target forward pass.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..constrain import ConstraintSpec, compile_constraint
from ..constrain.spec import strict_schema
from ..engine import default_eos_ids
from ..errors import SpeculumError
from ..methods import build_method
from ..prompts import encode_prompt
from ..result import FinishReason
from ..runners import runner_for
from .data import read_jsonl
from .report import fmt, write_files

PROMPT = ("Reply with one JSON object that follows this JSON schema, with realistic values. "
          "Output only the JSON.\nSchema: {schema}")
WARMUP_SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}


@dataclass
class SchemaCase:
    id: str
    dataset: str
    schema: dict


@dataclass
class StructuredRecord:
    method: str
    schema_id: str
    constrained: bool
    new_tokens: int
    forwards: int
    time_s: float
    finish_reason: FinishReason
    valid: bool
    mask_s: float
    forced: int
    prefill_s: float = 0.0  # the prompt's forward pass (hf: its first forward, which also gives a token)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return max(self.time_s - self.prefill_s, 0.0)


def load_schemas(path: str | Path) -> list[SchemaCase]:
    return read_jsonl(path, "schema file", "schemas",
                      lambda row, _: SchemaCase(str(row["id"]), str(row.get("dataset", "")), row["schema"]),
                      "not a JSONSchemaBench row ({e})")


def features(schema) -> set[str]:
    """Which schema features a schema uses (for the report): nesting, enum, array bounds, pattern,
    optional fields, refs, unions, formats."""
    found: set[str] = set()

    def walk(node, depth: int) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x, depth)
            return
        if not isinstance(node, dict):
            return
        props = node.get("properties")
        if isinstance(props, dict):
            if depth >= 1:
                found.add("nesting")
            if set(props) - set(node.get("required", [])):
                found.add("optional fields")
            for sub in props.values():
                walk(sub, depth + 1)
        if "enum" in node or "const" in node:
            found.add("enum")
        if "minItems" in node or "maxItems" in node:
            found.add("array bounds")
        if "pattern" in node or "patternProperties" in node:
            found.add("pattern")
        if "$ref" in node:
            found.add("$ref")
        if any(k in node for k in ("anyOf", "oneOf", "allOf")):
            found.add("unions")
        if "format" in node:
            found.add("format")
        for k, v in node.items():
            if k not in ("properties", "enum", "const", "default", "examples"):
                walk(v, depth + (1 if k == "items" else 0))

    walk(schema, 0)
    return found


def coverage(cases: list[SchemaCase], tokenizer, width: int, eos_ids) -> list[dict]:
    """Compile every schema (strict mode); one row per schema with ``ok``, ``error``, ``compile_ms``."""
    rows = []
    for c in cases:
        t0 = time.perf_counter()
        try:
            compile_constraint(ConstraintSpec.json_schema(strict_schema(c.schema)), tokenizer, width, eos_ids).matcher()
            ok, error = True, None
        except SpeculumError as e:
            ok, error = False, str(e).splitlines()[0][:300]
        rows.append({"id": c.id, "dataset": c.dataset, "ok": ok, "error": error,
                     "compile_ms": round(1000 * (time.perf_counter() - t0), 3),
                     "features": sorted(features(c.schema))})
    return rows


def prompt_ids(tokenizer, case: SchemaCase, chat: bool | None = None) -> list[int]:
    return encode_prompt(tokenizer, PROMPT.format(schema=json.dumps(case.schema)), chat)


def select(cases: list[SchemaCase], cov: list[dict], count: int, tokenizer, context: int, max_new_tokens: int,
           chat: bool | None = None) -> list[SchemaCase]:
    """``count`` compiled schemas spread evenly over the file (every k-th) whose prompt and output fit
    the model's context; each coverage row gets ``prompt_tokens`` and ``fits``."""
    ok = []
    for c, row in zip(cases, cov):
        row["prompt_tokens"] = len(prompt_ids(tokenizer, c, chat))
        row["fits"] = row["prompt_tokens"] + max_new_tokens <= context
        if row["ok"] and row["fits"]:
            ok.append(c)
    if count >= len(ok):
        return ok
    step = len(ok) / count
    return [ok[int(i * step)] for i in range(count)]


def is_valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError, RecursionError):
        return False


def run_structured(model, tokenizer, cases: list[SchemaCase], methods: list[str], max_new_tokens: int = 256,
                   chat: bool | None = None, progress: bool = True, close_reserve: int = 0) -> list[StructuredRecord]:
    """Run each method constrained and unconstrained on each schema, interleaved (greedy).
    ``close_reserve``: the grammars' budget closer (:class:`~speculum.constrain.Grammar`; 0: off)."""
    runner = runner_for(model)
    built = {m: build_method(m, model, tokenizer, runner=runner) for m in methods}
    eos = default_eos_ids(model, tokenizer)
    width = runner.vocab_size

    def grammar_for(schema):
        return compile_constraint(ConstraintSpec.json_schema(strict_schema(schema)), tokenizer, width, eos,
                                  close_reserve)

    warm = encode_prompt(tokenizer, PROMPT.format(schema=json.dumps(WARMUP_SCHEMA)), chat)
    for m in methods:
        built[m].run(warm, 16, grammar=grammar_for(WARMUP_SCHEMA))
        built[m].run(warm, 16)

    records: list[StructuredRecord] = []
    bar = tqdm(total=len(cases) * len(methods) * 2, desc="structured", unit="run", disable=not progress)
    for i, case in enumerate(cases):
        ids = prompt_ids(tokenizer, case, chat)
        grammar = grammar_for(case.schema)
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in order:
            for constrained in ((True, False) if i % 2 == 0 else (False, True)):
                bar.set_postfix_str(f"{case.id[-24:]}:{m}{'+json' if constrained else ''}")
                r = built[m].run(ids, max_new_tokens, grammar=grammar if constrained else None)
                stats = r.to_dict()
                valid = r.finish_reason in (FinishReason.EOS, FinishReason.CLOSED) and is_valid(r.text, case.schema)
                records.append(StructuredRecord(m, case.id, constrained, r.new_tokens, r.forwards, r.time_s,
                                                r.finish_reason, valid, stats["time_mask_s"], stats["forced"],
                                                r.prefill_s))
                bar.update()
    bar.close()
    return records


def summarize_structured(records: list[StructuredRecord], methods: list[str]) -> dict:
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    def rate(rs, seconds):  # all tokens over all of the time ``seconds(record)`` gives
        t = sum(seconds(r) for r in rs)
        return sum(r.new_tokens for r in rs) / t if t > 0 else None

    out = {}
    hf_tok_s = mean([r.tok_s for r in records if r.method == "hf" and r.constrained])
    for m in methods:
        con = [r for r in records if r.method == m and r.constrained]
        unc = [r for r in records if r.method == m and not r.constrained]
        if not con:
            continue
        tok_c, tok_u = mean([r.tok_s for r in con]), mean([r.tok_s for r in unc])
        new = sum(r.new_tokens for r in con)
        dec_c, dec_u = (rate(rs, lambda r: r.decode_s) for rs in (con, unc))
        all_c, all_u = (rate(rs, lambda r: r.time_s) for rs in (con, unc))
        out[m] = {
            "schemas": len(con),
            "valid": round(sum(r.valid for r in con) / len(con), 4),
            "finished": round(sum(r.finish_reason == FinishReason.EOS for r in con) / len(con), 4),
            "closed": round(sum(r.finish_reason == FinishReason.CLOSED for r in con) / len(con), 4),
            "valid_unconstrained": round(sum(r.valid for r in unc) / len(unc), 4) if unc else None,
            "decode_tok_s": round(dec_c, 3) if dec_c else None,
            "decode_tok_s_unconstrained": round(dec_u, 3) if dec_u else None,
            "decode_ratio": round(dec_c / dec_u, 4) if dec_c and dec_u else None,
            "tok_s": round(tok_c, 3),
            "tok_s_unconstrained": round(tok_u, 3) if tok_u else None,
            "constrained_over_unconstrained": round(tok_c / tok_u, 4) if tok_u else None,
            "overall_ratio": round(all_c / all_u, 4) if all_c and all_u else None,
            "speedup_vs_hf": round(tok_c / hf_tok_s, 4) if hf_tok_s else None,
            "mean_accepted": round(new / sum(r.forwards for r in con), 4) if con else None,
            "mask_us_per_token": None if m.startswith("hf") else round(1e6 * sum(r.mask_s for r in con) / max(new, 1), 1),
            "forced_frac": None if m.startswith("hf") else round(sum(r.forced for r in con) / max(new, 1), 4),
            "mean_new_tokens": round(new / len(con), 1),
        }
    return out


def markdown(summary: dict, cov: list[dict], used: list[SchemaCase], meta: dict) -> str:
    ok = sum(r["ok"] for r in cov)
    total, compiled = Counter(r["dataset"] for r in cov), Counter(r["dataset"] for r in cov if r["ok"])
    feats = Counter(f for c in used for f in features(c.schema))
    closer = f"in the last {meta['close_reserve']} tokens" if meta.get("close_reserve") else "off"
    lines = [(f"Model `{meta.get('model')}`, dtype {meta.get('dtype')}, greedy, max {meta.get('max_new_tokens')} new "
             f"tokens, {len(used)} schemas, budget closer {closer}."), "",
             f"Coverage (strict mode): {ok} of {len(cov)} schemas compile "
             + "(" + ", ".join(f"{k} {compiled[k]}/{v}" for k, v in total.items()) + ").", ""]
    refused = [r for r in cov if not r["ok"]]
    if refused:
        lines += ["Refused:", ""] + [f"- `{r['id']}`: {r['error']}" for r in refused] + [""]
    long = [r for r in cov if r["ok"] and not r.get("fits", True)]
    if long:
        lines += ["Compiled but left out, prompt too long for the context: "
                  + ", ".join(f"`{r['id']}` ({r['prompt_tokens']} tokens)" for r in long), ""]
    lines += ["Features among the schemas run: " + ", ".join(f"{k} {v}" for k, v in sorted(feats.items())), "",
              ("| method | valid | ended by the model | closed by the budget | valid unconstrained | "
               "decode tok/s constrained | decode tok/s unconstrained | decode ratio | "
               "tok/s constrained (with prefill) | tok/s unconstrained (with prefill) | ratio (with prefill) | "
               "ratio (all tokens / all time) | "
               "speedup vs hf (constrained, with prefill) | mean accepted | forced tokens | mask µs/token | new tokens |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m, s in summary.items():
        lines.append(f"| {m} | {fmt(100 * s['valid'], 0, '%')} | {fmt(100 * s['finished'], 0, '%')} | "
                     f"{fmt(100 * s['closed'], 0, '%')} | {fmt(100 * s['valid_unconstrained'], 0, '%')} | "
                     f"{fmt(s['decode_tok_s'], 1)} | {fmt(s['decode_tok_s_unconstrained'], 1)} | {fmt(s['decode_ratio'])} | "
                     f"{fmt(s['tok_s'], 1)} | {fmt(s['tok_s_unconstrained'], 1)} | "
                     f"{fmt(s['constrained_over_unconstrained'])} | {fmt(s['overall_ratio'])} | "
                     f"{fmt(s['speedup_vs_hf'], 2, 'x')} | "
                     f"{fmt(s['mean_accepted'])} | "
                     f"{'–' if s['forced_frac'] is None else fmt(100 * s['forced_frac'], 0, '%')} | "
                     f"{fmt(s['mask_us_per_token'], 0)} | {fmt(s['mean_new_tokens'], 0)} |")
    lines += ["", ("Decode tok/s: all generated tokens over all decoding time, the prompt's prefill left out (the "
              "same prompt is prefilled in both modes). With prefill: the mean over schemas of tokens / total "
              "time, which falls when the constrained answer is short. All tokens / all time: prefill "
              "included, summed over schemas.")]
    return "\n".join(lines) + "\n"


def write_structured(out_dir: str | Path, summary: dict, records: list[StructuredRecord], cov: list[dict],
                     used: list[SchemaCase], meta: dict) -> Path:
    full = {**meta, "coverage": {"compiled": sum(r["ok"] for r in cov), "total": len(cov), "rows": cov},
            "schemas_run": [c.id for c in used], "methods": summary}
    per_schema = "".join(json.dumps({**asdict(r), "tok_s": round(r.tok_s, 3)}) + "\n" for r in records)
    return write_files(out_dir, {"results.json": json.dumps(full, indent=2), "per_schema.jsonl": per_schema,
                                 "results.md": markdown(summary, cov, used, meta)})


# no grammar support, or a second model
UNSUPPORTED_METHODS = ("hf_pld", "hf_assisted", "draft_model", "draft_model_tree", "cross_vocab", "llama_cpp",
                       "llama_cpp_lookup")


def check_settings(schemas: str | None, n_schemas: int, methods: list[str], temperature: float,
                   close_reserve: int) -> list[SchemaCase]:
    """The benchmark's settings, checked before any model loads; returns the schemas."""
    if not schemas:
        raise SpeculumError("--workload structured needs --schemas FILE (e.g. "
                            "../shared/data/jsonschemabench/schemas_dev.jsonl)")
    cases = load_schemas(schemas)
    if n_schemas < 1:
        raise SpeculumError("--n-schemas must be at least 1")
    if temperature != 0:
        raise SpeculumError("the structured benchmark is greedy: leave --temperature at 0")
    if close_reserve < 0:
        raise SpeculumError("--close-reserve must be >= 0")
    bad = [m for m in methods if m in UNSUPPORTED_METHODS]
    if bad:
        raise SpeculumError(f"the structured benchmark runs hf and speculum's engine methods, not {', '.join(bad)}")
    return cases


def bench_structured(model, tokenizer, cases: list[SchemaCase], methods: list[str], n_schemas: int,
                     max_new_tokens: int, chat: bool | None, progress: bool, close_reserve: int, meta: dict,
                     out_dir: str | Path) -> tuple[str, Path]:
    """Coverage over every schema, then the run on ``n_schemas`` of them; writes ``results.json``,
    ``results.md`` and ``per_schema.jsonl`` into ``out_dir``. Returns the report and the directory."""
    runner = runner_for(model)
    cov = coverage(cases, tokenizer, runner.vocab_size, default_eos_ids(model, tokenizer))
    used = select(cases, cov, n_schemas, tokenizer, runner.max_positions, max_new_tokens, chat)
    records = run_structured(model, tokenizer, used, methods, max_new_tokens, chat, progress,
                             close_reserve=close_reserve)
    summary = summarize_structured(records, methods)
    meta = {**meta, "max_new_tokens": max_new_tokens, "close_reserve": close_reserve}
    out = write_structured(out_dir, summary, records, cov, used, meta)
    return markdown(summary, cov, used, meta), out
