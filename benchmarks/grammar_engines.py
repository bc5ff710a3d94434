"""Measure two grammar engines, llguidance and xgrammar, on real JSON schemas.

For each engine and each schema of a JSONL file (one ``{"id", "dataset", "schema"}`` a line, e.g.
``/work/shared/data/jsonschemabench/schemas_dev.jsonl``) this records:

* whether the schema compiles (any error = unsupported; the error message is kept),
* compile time: schema -> ready matcher (ms), and the first mask separately (llguidance compiles
  lazily, so part of its work lands in the first masks),
* mask time per token: a seeded random walk of allowed tokens; every step times the computation
  of the next-token bitmask alone, then consumes the picked token.  Before ``--steps`` steps the
  stop token is never picked (unless it is the only choice); from then on the stop token is
  picked as soon as it is allowed, and otherwise a token made only of closing characters
  (``"``, ``}``, ``]``) is preferred, so that most walks end as complete JSON within
  ``--max-steps``,
* soundness: a complete walk's decoded text is parsed and validated against the schema with
  ``jsonschema`` (without and with format checking; remote ``$ref`` are not fetched).

Engines (``--engines``):

* ``llguidance``: ``LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible":
  False, "item_separator": ", ", "key_separator": ": "})`` then ``LLMatcher(lltok, grammar)``;
  unsupported = ValueError or ``matcher.is_error()``.  ``lenient`` is left at its default (off):
  unimplemented keywords are errors.
* ``llguidance-lenient``: the same with ``lenient: True`` (unknown keywords are ignored, so a
  "compile" here may be looser than the schema; reported for information only).
* ``xgrammar``: ``GrammarCompiler(TokenizerInfo.from_huggingface(tok, vocab_size=V),
  cache_enabled=False).compile_json_schema(json.dumps(schema), any_whitespace=False)`` (default
  separators ``", "``/``": "``, default ``strict_mode=True``) then ``GrammarMatcher``.

Each engine runs in its own worker process, one schema at a time (engines never run at the same
time); a schema whose compile exceeds ``--compile-timeout`` or whose walk exceeds
``--walk-timeout`` is recorded as a timeout and the worker is restarted.

The project's venv pins packages this script should not disturb, so run it from a separate venv::

    python3.11 -m venv /tmp/xgvenv
    /tmp/xgvenv/bin/pip install torch==2.13.0          # the CPU build; never an unpinned torch
    /tmp/xgvenv/bin/pip install xgrammar llguidance transformers gguf jsonschema
    # tokenizer of the project's default model, saved once with the project's venv:
    .venv/bin/python -c "from speculum import models; m,t=models.load('default'); \\
        t.save_pretrained('/tmp/smollm2_tok')"
    /tmp/xgvenv/bin/python benchmarks/grammar_engines.py \\
        --schemas /work/shared/data/jsonschemabench/schemas_dev.jsonl \\
        --tokenizer /tmp/smollm2_tok --vocab-size 49152 \\
        --out docs/structured/grammar_engines.json
    # summary tables (markdown) from a results file:
    /tmp/xgvenv/bin/python benchmarks/grammar_engines.py --report docs/structured/grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Self

ENGINES = ("llguidance", "llguidance-lenient", "xgrammar")
CLOSERS = set('"}]')
WARMUP_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
}


# --------------------------------------------------------------------------------------------
# engine adapters (run inside the worker process)


class _LLGuidance:
    def __init__(self, tok: Any, vocab_size: int, lenient: bool) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.options = {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
        }
        if lenient:
            self.options["lenient"] = True
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.m = None

    def compile(self, schema: Any) -> tuple[str | None, list[str]]:
        """Build a matcher; return (error or None, warnings)."""
        self.m = None
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        except Exception as e:  # noqa: BLE001 - any error means unsupported
            return f"{type(e).__name__}: {e}", []
        m = self.llg.LLMatcher(self.lltok, grammar)
        if m.is_error():
            return m.get_error(), []
        self.m = m
        try:
            warnings = list(m.get_grammar_warnings())
        except Exception:  # noqa: BLE001
            warnings = []
        return None, warnings

    def fill(self) -> None:
        self._fill(self.m, self.bitmask)

    def consume(self, token: int) -> bool:
        return bool(self.m.consume_token(token)) and not self.m.is_error()

    def error(self) -> str | None:
        return self.m.get_error() if self.m is not None and self.m.is_error() else None


class _XGrammar:
    def __init__(self, tok: Any, vocab_size: int, threads: int | None) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        kw = {"cache_enabled": False}
        if threads:
            kw["max_threads"] = threads
        self.compiler = xgrammar.GrammarCompiler(info, **kw)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.m = None

    def compile(self, schema: Any) -> tuple[str | None, list[str]]:
        self.m = None
        try:
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            self.m = self.xgr.GrammarMatcher(compiled)
        except Exception as e:  # noqa: BLE001 - any error means unsupported
            return f"{type(e).__name__}: {e}", []
        return None, []

    def fill(self) -> None:
        self.m.fill_next_token_bitmask(self.bitmask)

    def consume(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def error(self) -> str | None:
        return None


def _make_engine(name: str, tok: Any, vocab_size: int, xgr_threads: int | None) -> Any:
    if name == "llguidance":
        return _LLGuidance(tok, vocab_size, lenient=False)
    if name == "llguidance-lenient":
        return _LLGuidance(tok, vocab_size, lenient=True)
    if name == "xgrammar":
        return _XGrammar(tok, vocab_size, xgr_threads)
    raise ValueError(name)


# --------------------------------------------------------------------------------------------
# the walk


def _allowed(bitmask: Any, vocab_size: int) -> Any:
    import numpy as np

    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def _validate(text: str, schema: Any) -> dict[str, Any]:
    """Parse ``text`` and validate it against ``schema`` (no network)."""
    out: dict[str, Any] = {"json_ok": False, "valid": None, "valid_formats": None, "invalid_why": None}
    try:
        inst = json.loads(text)
    except Exception as e:  # noqa: BLE001
        out["invalid_why"] = f"not JSON: {e}"
        return out
    out["json_ok"] = True
    try:
        import jsonschema
        import referencing

        def _no_fetch(uri: str) -> Any:
            raise referencing.exceptions.NoSuchResource(ref=uri)

        registry = referencing.Registry(retrieve=_no_fetch)
        cls = jsonschema.validators.validator_for(schema)
        errs = list(cls(schema, registry=registry).iter_errors(inst))
        out["valid"] = not errs
        if errs:
            best = jsonschema.exceptions.best_match(errs)
            out["invalid_why"] = f"at {best.json_path}: {best.message[:300]}"
        errs_f = list(cls(schema, registry=registry, format_checker=cls.FORMAT_CHECKER).iter_errors(inst))
        out["valid_formats"] = not errs_f
        if errs_f and not errs:
            out["invalid_why"] = "format: " + errs_f[0].message[:300]
    except Exception as e:  # noqa: BLE001 - unresolvable refs, invalid schema, ...
        out["valid"] = None
        out["invalid_why"] = f"validator error: {type(e).__name__}: {str(e)[:300]}"
    return out


def _walk(
    eng: Any, tok: Any, eos: int, closer_ids: Any, vocab_size: int, steps: int, max_steps: int, seed: int
) -> dict[str, Any]:
    import numpy as np

    rng = random.Random(seed)
    mask_ns: list[int] = []
    consume_ns: list[int] = []
    tokens: list[int] = []
    status = "truncated"
    err = None
    for step in range(max_steps):
        t0 = time.perf_counter_ns()
        eng.fill()
        mask_ns.append(time.perf_counter_ns() - t0)
        allowed = _allowed(eng.bitmask, vocab_size)
        if allowed.size == 0:
            status, err = "dead-end", eng.error() or "empty mask"
            break
        eos_ok = bool(np.any(allowed == eos))
        if eos_ok and (step >= steps or allowed.size == 1):
            pick = eos
        else:
            pool = allowed[allowed != eos] if eos_ok else allowed
            if step >= steps:
                closers = pool[closer_ids[pool]]
                if closers.size:
                    pool = closers
            pick = int(pool[rng.randrange(pool.size)])
        t0 = time.perf_counter_ns()
        ok = eng.consume(pick)
        consume_ns.append(time.perf_counter_ns() - t0)
        if not ok:
            status, err = "rejected", eng.error() or f"allowed token {pick} rejected"
            break
        if pick == eos:
            status = "complete"
            break
        tokens.append(pick)
    return {
        "status": status,
        "walk_error": err,
        "n_steps": len(mask_ns),
        "mask_ns": mask_ns,
        "consume_ns": consume_ns,
        "text": tok.decode(tokens),
    }


class _CaptureStderr:
    """Capture what native code writes to file descriptor 2."""

    def __enter__(self) -> Self:
        import tempfile

        sys.stderr.flush()
        self.f = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.f.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.f.seek(0)
        self.text = self.f.read().decode(errors="replace")
        self.f.close()


def _worker(conn: Any, engine: str, args: dict[str, Any]) -> None:
    import numpy as np
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args["tokenizer"])
    vocab_size = args["vocab_size"]
    eng = _make_engine(engine, tok, vocab_size, args["xgr_threads"])
    eos = tok.eos_token_id
    closer_ids = np.zeros(vocab_size, dtype=bool)
    for i in range(min(len(tok), vocab_size)):
        s = tok.decode([i])
        closer_ids[i] = bool(s) and set(s) <= CLOSERS
    # warm-up (not recorded): first compile and a few masks in a fresh process
    if eng.compile(WARMUP_SCHEMA)[0] is None:
        _walk(eng, tok, eos, closer_ids, vocab_size, 5, 20, 0)
    conn.send(("ready", time.perf_counter() - t0))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        schema, seed = msg
        with _CaptureStderr() as cap:  # xgrammar logs its approximations to fd 2
            t0 = time.perf_counter_ns()
            err, warnings = eng.compile(schema)
            compile_ms = (time.perf_counter_ns() - t0) / 1e6
        warnings = warnings + [ln.strip() for ln in cap.text.splitlines() if ln.strip()]
        conn.send(
            (
                "compiled",
                {"compiled": err is None, "error": err, "warnings": warnings[:5], "compile_ms": compile_ms},
            )
        )
        if err is not None:
            continue
        w = _walk(eng, tok, eos, closer_ids, vocab_size, args["steps"], args["max_steps"], seed)
        if w["status"] == "complete":
            w.update(_validate(w["text"], schema))
        conn.send(("walked", w))


# --------------------------------------------------------------------------------------------
# driver


class _Worker:
    def __init__(self, engine: str, args: dict[str, Any]) -> None:
        self.engine, self.args = engine, args
        self.ctx = mp.get_context("spawn")
        self._start()

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.engine, self.args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise RuntimeError(f"{self.engine} worker did not start")
        self.setup_s = self.conn.recv()[1]

    def restart(self) -> None:
        self.proc.kill()
        self.proc.join()
        self._start()

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            return None
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "machine": platform.platform()}
    for p in ("llguidance", "xgrammar", "torch", "transformers", "jsonschema"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.schemas) as f:
        rows_in = [json.loads(line) for line in f if line.strip()]
    if args.limit:
        rows_in = rows_in[: args.limit]
    wargs = {
        "tokenizer": args.tokenizer,
        "vocab_size": args.vocab_size,
        "steps": args.steps,
        "max_steps": args.max_steps,
        "xgr_threads": args.xgr_threads,
    }
    results: list[dict[str, Any]] = []
    setup: dict[str, float] = {}
    t_all = time.perf_counter()
    for engine in args.engines:
        w = _Worker(engine, wargs)
        setup[engine] = w.setup_s
        t_eng = time.perf_counter()
        for i, r in enumerate(rows_in):
            row: dict[str, Any] = {"engine": engine, "id": r["id"], "dataset": r["dataset"]}
            w.conn.send((r["schema"], args.seed + i))
            msg = w.recv(args.compile_timeout)
            if msg is None:
                row.update(
                    compiled=False, error=f"timeout: compile > {args.compile_timeout} s", compile_ms=None
                )
                w.restart()
            else:
                row.update(msg[1])
                if row["compiled"]:
                    msg = w.recv(args.walk_timeout)
                    if msg is None:
                        row.update(status="timeout", walk_error=f"walk > {args.walk_timeout} s")
                        w.restart()
                    else:
                        wk = msg[1]
                        mask_ns, consume_ns = wk.pop("mask_ns"), wk.pop("consume_ns")
                        row.update(wk)
                        row["first_mask_us"] = mask_ns[0] / 1e3 if mask_ns else None
                        row["mask_us"] = [round(x / 1e3, 2) for x in mask_ns]
                        row["mask_mean_us"] = statistics.fmean(mask_ns) / 1e3 if mask_ns else None
                        row["mask_p99_us"] = _pct(mask_ns, 99) / 1e3 if mask_ns else None
                        row["consume_mean_us"] = statistics.fmean(consume_ns) / 1e3 if consume_ns else None
            results.append(row)
            if args.verbose:
                print(
                    f"{engine:19s} {i:3d} {r['id'][:48]:48s} "
                    f"{'ok ' if row['compiled'] else 'ERR'} "
                    f"{row.get('compile_ms') or 0:9.2f} ms {row.get('status', '')}",
                    flush=True,
                )
        w.close()
        print(f"{engine}: {time.perf_counter() - t_eng:.1f} s", file=sys.stderr, flush=True)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "report", "verbose")},
        "versions": _versions(),
        "worker_setup_s": setup,
        "total_s": time.perf_counter() - t_all,
        "rows": results,
    }


# --------------------------------------------------------------------------------------------
# report


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _short(msg: str) -> str:
    """First line of an engine message, without xgrammar's ``[time] file:line:`` prefix."""
    import re

    line = msg.splitlines()[0] if msg else ""
    return re.sub(r"^(\w+Error: )?\[[\d:]+\] \S+\.cc:\d+: ", r"\1", line)[:200]


def report(data: dict[str, Any]) -> str:
    rows = data["rows"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    n_per = {d: sum(1 for r in rows if r["dataset"] == d and r["engine"] == engines[0]) for d in datasets}
    out = []
    out.append(
        f"| engine | compiled (of {sum(n_per.values())}) | "
        + " | ".join(f"{d} ({n_per[d]})" for d in datasets)
        + " |"
    )
    out.append("|---|---|" + "---|" * len(datasets))
    for e in engines:
        er = [r for r in rows if r["engine"] == e]
        per = [sum(1 for r in er if r["dataset"] == d and r["compiled"]) for d in datasets]
        out.append(f"| {e} | {sum(r['compiled'] for r in er)} | " + " | ".join(map(str, per)) + " |")
    out.append("")
    out.append(
        "| engine | compile ms median | p90 | max | first mask µs median | p90 | "
        "mask µs/token mean | p50 | p99 | max | steps timed |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for e in engines:
        er = [r for r in rows if r["engine"] == e and r["compiled"]]
        c = [r["compile_ms"] for r in er]
        fm = [r["first_mask_us"] for r in er if r.get("first_mask_us") is not None]
        m = [x for r in er for x in r.get("mask_us", [])]
        out.append(
            f"| {e} | {_pct(c, 50):.2f} | {_pct(c, 90):.2f} | {max(c):.1f} | {_pct(fm, 50):.0f} | "
            f"{_pct(fm, 90):.0f} | {statistics.fmean(m):.0f} | {_pct(m, 50):.0f} | "
            f"{_pct(m, 99):.0f} | {max(m):.0f} | {len(m)} |"
        )
    out.append("")
    out.append(
        "| engine | walks complete | truncated | dead-end / rejected | timeout | "
        "complete & valid | invalid | valid incl. formats | not checkable |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for e in engines:
        er = [r for r in rows if r["engine"] == e and r["compiled"]]
        st = [r.get("status") for r in er]
        comp = [r for r in er if r.get("status") == "complete"]
        out.append(
            f"| {e} | {st.count('complete')} | {st.count('truncated')} | "
            f"{st.count('dead-end') + st.count('rejected')} | {st.count('timeout')} | "
            f"{sum(r.get('valid') is True for r in comp)} | "
            f"{sum(r.get('valid') is False or not r.get('json_ok') for r in comp)} | "
            f"{sum(r.get('valid_formats') is True for r in comp)} | "
            f"{sum(r.get('valid') is None and r.get('json_ok', False) for r in comp)} |"
        )
    out.append("")
    for e in engines:
        bad = [r for r in rows if r["engine"] == e and not r["compiled"]]
        if bad:
            out.append(f"Unsupported by {e} ({len(bad)}):")
            for r in bad:
                out.append(f"- `{r['id']}`: {_short(r['error'])}")
            out.append("")
    for e in engines:
        warned = [r for r in rows if r["engine"] == e and r["compiled"] and r.get("warnings")]
        if warned:
            out.append(f"Compiled with warnings by {e} ({len(warned)}):")
            for r in warned:
                ws = sorted({_short(w) for w in r["warnings"]})
                out.append(f"- `{r['id']}`: " + "; ".join(ws))
            out.append("")
    for e in engines:
        bad = [
            r
            for r in rows
            if r["engine"] == e
            and r["compiled"]
            and (
                r.get("status") in ("dead-end", "rejected", "timeout")
                or (r.get("status") == "complete" and (r.get("valid") is False or not r.get("json_ok")))
            )
        ]
        if bad:
            out.append(f"Walk problems for {e} ({len(bad)}):")
            for r in bad:
                why = r.get("walk_error") or r.get("invalid_why") or ""
                out.append(
                    f"- `{r['id']}` [{r.get('status')}]: {_short(why)} — text: `{r.get('text', '')[:120]}`"
                )
            out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", default="/work/shared/data/jsonschemabench/schemas_dev.jsonl")
    ap.add_argument("--tokenizer", default="/tmp/smollm2_tok")
    ap.add_argument("--vocab-size", type=int, default=49152, help="logits width")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--steps", type=int, default=40, help="random steps before steering to the end")
    ap.add_argument("--max-steps", type=int, default=200, help="hard cap on walk length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-timeout", type=float, default=30.0, help="seconds per schema")
    ap.add_argument("--walk-timeout", type=float, default=60.0, help="seconds per schema")
    ap.add_argument(
        "--xgr-threads",
        type=int,
        default=None,
        help="xgrammar GrammarCompiler max_threads (default: library default)",
    )
    ap.add_argument("--limit", type=int, default=0, help="only the first N schemas")
    ap.add_argument("--out", default=None, help="write raw per-schema rows here (JSON)")
    ap.add_argument("--report", default=None, help="print markdown tables for this results file")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return
    data = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(report(data))


if __name__ == "__main__":
    main()
