"""``speculum calibrate``: the forward cost curves that size draft trees."""

from __future__ import annotations

from ..errors import SpeculumError


def add_parser(sub) -> None:
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


def run(args) -> int:
    from ..calibrate import CONTEXTS, load_or_measure, write_report
    from ..loading import load
    from ..models import dtype_name, parse_dtype
    from ..runners import RUNNER_KINDS, runner_for

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
