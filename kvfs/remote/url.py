"""``nvme-tcp://HOST:PORT/SUBNQN?hostnqn=…&queues=…&depth=…&digest=header,data&timeout=…`` URLs."""
from __future__ import annotations

import dataclasses
import uuid
from urllib.parse import parse_qs, unquote, urlsplit

from kvfs.remote.errors import UrlError

DEFAULT_PORT = 4420
_KEYS = {"hostnqn", "hostid", "queues", "depth", "digest", "timeout", "kato", "nsid", "max_io"}


@dataclasses.dataclass(frozen=True)
class RemoteUrl:
    host: str
    port: int
    subnqn: str
    hostnqn: str
    hostid: bytes                   # 16 bytes
    queues: int = 2                 # I/O queues (one TCP connection each)
    depth: int = 64                 # commands per I/O queue (>= 32)
    hdgst: bool = False
    ddgst: bool = False
    timeout: float = 5.0            # seconds, every command
    kato: float = 10.0              # keep-alive timeout (s); 0 disables
    nsid: int = 0                   # 0: the first active namespace
    max_io: int = 1 << 20           # largest single read/write command (further capped by MDTS)

    def __str__(self) -> str:
        return f"nvme-tcp://{self.host}:{self.port}/{self.subnqn}"


def is_nvme_tcp(text: str) -> bool:
    return str(text).startswith("nvme-tcp://")


def _int(q: dict, key: str, default: int, lo: int, hi: int) -> int:
    if key not in q:
        return default
    try:
        v = int(q[key])
    except ValueError:
        raise UrlError(f"{key}={q[key]!r} is not an integer") from None
    if not lo <= v <= hi:
        raise UrlError(f"{key}={v} out of range [{lo}, {hi}]")
    return v


def _float(q: dict, key: str, default: float, lo: float, hi: float) -> float:
    if key not in q:
        return default
    try:
        v = float(q[key])
    except ValueError:
        raise UrlError(f"{key}={q[key]!r} is not a number") from None
    if not lo <= v <= hi:
        raise UrlError(f"{key}={v} out of range [{lo}, {hi}]")
    return v


def parse_url(text: str, *, instance_id: str = "") -> RemoteUrl:
    """Parse and validate; the host NQN/ID default to ones derived from ``instance_id``."""
    s = str(text).strip()
    if not is_nvme_tcp(s):
        raise UrlError(f"not an nvme-tcp:// URL: {s!r}")
    u = urlsplit(s)
    try:
        host, port = u.hostname, u.port or DEFAULT_PORT
    except ValueError as e:
        raise UrlError(f"bad host/port in {s!r}: {e}") from None
    if not host:
        raise UrlError(f"no host in {s!r}")
    subnqn = unquote(u.path.lstrip("/"))
    if not subnqn:
        raise UrlError(f"no subsystem NQN in {s!r} (nvme-tcp://HOST:PORT/SUBNQN)")
    if len(subnqn.encode()) > 223 or not subnqn.startswith("nqn."):
        raise UrlError(f"bad subsystem NQN {subnqn!r}")
    raw = parse_qs(u.query, keep_blank_values=True, strict_parsing=False)
    q = {k: v[-1] for k, v in raw.items()}
    unknown = set(q) - _KEYS
    if unknown:
        raise UrlError(f"unknown URL parameter(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(_KEYS))})")
    seed = uuid.uuid5(uuid.NAMESPACE_URL, f"kvfs:{instance_id or 'kvfs'}")
    if "hostid" in q:
        try:
            hostid = uuid.UUID(q["hostid"])
        except ValueError:
            raise UrlError(f"hostid={q['hostid']!r} is not a UUID") from None
    else:
        hostid = seed
    hostnqn = q.get("hostnqn") or f"nqn.2014-08.org.nvmexpress:uuid:{hostid}"
    if len(hostnqn.encode()) > 223:
        raise UrlError("hostnqn longer than 223 bytes")
    digests = {d.strip() for d in q.get("digest", "").split(",") if d.strip()}
    if digests - {"header", "data", "none"}:
        raise UrlError(f"digest= takes header,data (got {q['digest']!r})")
    return RemoteUrl(
        host=host, port=port, subnqn=subnqn, hostnqn=hostnqn, hostid=hostid.bytes,
        queues=_int(q, "queues", 2, 1, 64), depth=_int(q, "depth", 64, 32, 1024),
        hdgst="header" in digests, ddgst="data" in digests,
        timeout=_float(q, "timeout", 5.0, 0.1, 600), kato=_float(q, "kato", 10.0, 0, 3600),
        nsid=_int(q, "nsid", 0, 0, 0xFFFFFFFE), max_io=_int(q, "max_io", 1 << 20, 4096, 1 << 30),
    )
