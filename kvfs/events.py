"""KV events: what happened to which block, for readers of ``.kvfs/events``.

Each reader (an open descriptor of ``.kvfs/events``) has its own bounded queue. The store
emits events synchronously on the trio thread; an emit with no reader costs one attribute
test. A reader that falls behind loses the oldest events of its queue, never slows the
filesystem: the next line it reads is a ``{"event": "dropped", "count": N}`` record saying
how many it lost since its last read.

An event is one JSON object per line::

    {"event": "stored", "time": 1764790000.123, "path": "/ns/ab/ab12….kv", "namespace": "ns",
     "hash": "ab12…", "parent": "…", "tokens": "16", "tier": "ram", "size": 1048576, "seq": 7}

``event`` is one of ``stored`` (a new version was sealed), ``promoted`` (copied up to
``tier``), ``demoted`` (moved down to ``tier``), ``evicted`` (dropped from the cache under
pressure or by admission), ``removed`` (unlinked, replaced, or lost to a checksum failure).
Empty files make no events. ``hash``, ``parent`` and ``tokens`` come from the kvfs block header (kvfs.blockformat) and are
null for other files; ``namespace`` is the block's KV namespace, else the top-level directory.
"""
from __future__ import annotations

import collections
import json
import logging
import time

import trio

log = logging.getLogger(__name__)

QUEUE_EVENTS = 4096          # events one reader may lag behind before it loses the oldest
KINDS = ("stored", "promoted", "demoted", "evicted", "removed")


class Subscriber:
    """One reader's queue of encoded lines."""

    def __init__(self, limit: int = QUEUE_EVENTS):
        self.queue: collections.deque[bytes] = collections.deque()
        self.limit = limit
        self.dropped = 0            # lost since the last read
        self.dropped_total = 0
        self.wakeup = trio.Event()
        self.closed = False
        self.pending = b""          # encoded bytes handed out partially (a short read buffer)

    def push(self, line: bytes) -> None:
        if len(self.queue) >= self.limit:
            self.queue.popleft()
            self.dropped += 1
            self.dropped_total += 1
        self.queue.append(line)
        self.wakeup.set()

    def take(self, size: int) -> bytes:
        """Up to ``size`` bytes of whole lines (at least one line, split only if it is longer
        than ``size``), led by a ``dropped`` record when events were lost."""
        if self.dropped:
            self.queue.appendleft(_encode({"event": "dropped", "count": self.dropped, "time": time.time()}))
            self.dropped = 0
        out = bytearray(self.pending)
        self.pending = b""
        while self.queue and len(out) + len(self.queue[0]) <= size:
            out += self.queue.popleft()
        if not out and self.queue:
            line = self.queue.popleft()
            out, self.pending = bytearray(line[:size]), line[size:]
        if len(out) > size:
            out, self.pending = out[:size], bytes(out[size:])
        if not self.queue and not self.pending and not self.dropped:
            self.wakeup = trio.Event()
        return bytes(out)

    def ready(self) -> bool:
        return bool(self.queue or self.pending or self.dropped)


def _encode(doc: dict) -> bytes:
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


class EventHub:
    """The set of readers and the emit side (see the module docstring)."""

    def __init__(self):
        self.subscribers: set[Subscriber] = set()
        self.emitted = {k: 0 for k in KINDS}
        self.seq = 0
        self.lost = 0               # events dropped by readers that have since closed
        self.queue_limit = QUEUE_EVENTS
        # (obj) -> (path, kv record or None); set by the cache (it knows names)
        self.describe = lambda obj: (getattr(obj, "key", ""), None)

    @property
    def active(self) -> bool:
        return bool(self.subscribers)

    def subscribe(self) -> Subscriber:
        s = Subscriber(self.queue_limit)
        self.subscribers.add(s)
        return s

    def unsubscribe(self, s: Subscriber) -> None:
        if s in self.subscribers:
            self.lost += s.dropped_total
        self.subscribers.discard(s)
        s.closed = True
        s.wakeup.set()

    def close(self) -> None:
        """Wake every reader: the daemon is shutting down (their reads return end of file)."""
        for s in list(self.subscribers):
            self.unsubscribe(s)

    def emit(self, kind: str, obj, tier: str | None, *, path: str | None = None,
             kv: dict | None = None) -> None:
        """Record ``kind`` for ``obj`` (an Obj). ``path``/``kv`` when the caller knows them
        (a removal, after which the name can no longer be looked up)."""
        if not obj.size:            # an empty file is no KV block (and every create starts as one)
            return
        self.emitted[kind] += 1
        if not self.subscribers:
            return
        if path is None:
            try:
                path, found = self.describe(obj)
            except Exception as e:      # noqa: BLE001 - an event must never fail the operation
                log.debug("cannot describe object %x: %s", obj.oid, e)
                path, found = getattr(obj, "key", ""), None
            kv = kv if kv is not None else found
        self.seq += 1
        doc = {"event": kind, "time": time.time(), "path": path,
               "namespace": (kv or {}).get("namespace") or _top(path),
               "hash": (kv or {}).get("hash") or None, "parent": (kv or {}).get("parent") or None,
               "tokens": (kv or {}).get("tokens") or None, "tier": tier, "size": obj.size,
               "seq": self.seq}
        line = _encode(doc)
        for s in self.subscribers:
            s.push(line)

    def statistics(self) -> dict:
        return {"readers": len(self.subscribers), "emitted": dict(self.emitted),
                "queued": sum(len(s.queue) for s in self.subscribers),
                "dropped": self.lost + sum(s.dropped_total for s in self.subscribers)}


def _top(path: str) -> str:
    head, sep, _ = (path or "").lstrip("/").partition("/")
    return head if sep else "/"
