"""``name:key=value,...`` strings: how a KV policy (``tidal:layers=6+14``) or a method's settings are
named on the command line."""

from __future__ import annotations

from .errors import SpeculumError


def parse_named(spec: str, what: str) -> tuple[str, dict[str, str]]:
    """``"tidal:layers=6+14,kernel=7"`` -> ``("tidal", {"layers": "6+14", "kernel": "7"})``; ``what``
    names the thing in errors (``"KV policy"``)."""
    name, _, opts = spec.partition(":")
    kwargs = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise SpeculumError(f"{what} option {item!r} should read key=value")
        kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs
