"""Sizes as people write them (``64MiB``, ``10GiB``, ``50%``) and as kvfs prints them; shared by
the config, the CLI and the tiers (a neutral module: it imports nothing of kvfs but its errors)."""
from __future__ import annotations

import re

from kvfs.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, whole: int | None = None) -> int:
    """Parse ``64MiB``, ``10GiB``, ``4096`` or ``50%`` (of ``whole``) into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    s = str(text).strip()
    if s.endswith("%"):
        if whole is None:
            raise ConfigError(f"a percentage is not allowed here: {text!r}")
        try:
            pct = float(s[:-1])
        except ValueError:
            raise ConfigError(f"unparsable size: {text!r}") from None
        if not 0 < pct <= 100:
            raise ConfigError(f"percentage out of range (0, 100]: {text!r}")
        return int(whole * pct / 100)
    m = _SIZE_RE.match(s)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"unparsable size: {text!r} (use e.g. 64MiB, 10GiB, 50%)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
