"""The types of kvfs.integrations.pages: its errors, counters, lease holds and read pieces."""
from __future__ import annotations

import dataclasses
import threading

from kvfs.kv.blockio import Backing, LeaseClient

PIECE = 512 << 10          # leased reads land and are hashed in pieces of about this size


class NotOnKvfs(OSError):
    """The page directory is not (or no longer) inside a kvfs mount."""


class Stalled(OSError):
    """A kvfs request of this store has been waiting longer than ``stall_timeout``."""


class PageSizeError(OSError):
    """A page file does not have the size the caller's page has (another geometry)."""


@dataclasses.dataclass(frozen=True)
class PageStoreStats:
    """Counters of one PageStore (pages unless said otherwise)."""

    lookups: int            # existence queries (one round trip each on kvfs)
    lookup_hits: int        # pages found by them
    lookup_misses: int      # pages asked about and not found (past the prefix)
    gets: int               # pages asked for
    hits: int               # pages read back and verified
    misses: int             # pages not read (absent, or any error)
    bytes_read: int
    lease_fallbacks: int    # pages read through the mount (no fast path for them)
    sets: int               # pages asked to store
    written: int
    skipped: int            # already present: not rewritten
    set_failures: int
    bytes_written: int
    checksum_errors: int
    errors: int             # failed calls (each made its pages misses / failed sets)
    stalled: int            # calls answered "miss" at once: an earlier request is still waiting
    reconnects: int
    commit_refused: int = 0  # pages the batched commit refused (then written through the mount)
    batch_reads: int = 0     # pages without a fast path read by one .kvfs/get per batch
    table_misses: int = 0    # misses the name table answered (kvfs.kv.names: no round trip)
    table_stats: int = 0     # stats of a directory for the table (0 per miss once its inode is cached)
    table_hits: int = 0      # pages the name table listed (existence answered with no round trip)


@dataclasses.dataclass
class LeaseHold:
    """A lease kept on a descriptor of its own (see :meth:`PageStore.hold`): the daemon keeps
    the leased pages where they are, and their backing files valid, until it is released
    (or its ttl runs out)."""

    client: LeaseClient | None     # None: a plain directory (nothing to pin)
    backings: dict[str, Backing | None]   # leased pages -> fast path (None: read via the mount)
    epoch: int


_FIELDS = tuple(f.name for f in dataclasses.fields(PageStoreStats))


class Counters:
    """PageStoreStats counters without a lock per count: each thread adds to a dict of its own
    (only its thread writes it; a reader sums every thread's dict, a single load each)."""

    def __init__(self):
        self._local = threading.local()
        self._all: list[dict[str, int]] = []
        self._lock = threading.Lock()       # registers a thread's dict; taken once per thread

    def mine(self) -> dict[str, int]:
        try:
            return self._local.d
        except AttributeError:
            d = self._local.d = dict.fromkeys(_FIELDS, 0)
            with self._lock:
                self._all.append(d)
            return d

    def add(self, **kw: int) -> None:
        d = self.mine()
        for k, v in kw.items():
            d[k] += v

    def snapshot(self) -> PageStoreStats:
        with self._lock:
            ds = list(self._all)
        return PageStoreStats(**{k: sum(d[k] for d in ds) for k in _FIELDS})


def cuts(segs: list[memoryview]) -> list[tuple[int, int, int]]:
    """Group ``segs`` into pieces of about PIECE bytes: ``(first, end, nbytes)``."""
    cuts, first, size = [], 0, 0
    for i, s in enumerate(segs):
        size += len(s)
        if size >= PIECE:
            cuts.append((first, i + 1, size))
            first, size = i + 1, 0
    if first < len(segs):
        cuts.append((first, len(segs), size))
    return cuts
