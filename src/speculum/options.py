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


def parse_flag(value) -> bool:
    """An on/off option: ``True``, ``"1"``, ``"true"``, ``"yes"``, ``"on"`` -> True; ``False``, ``"0"``,
    ``"false"``, ``"no"``, ``"off"`` -> False; anything else raises ``ValueError``."""
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected an on/off flag (1 or 0), got {value!r}")
