"""The one small interface every tier implements (RAM, local NVMe, remote).

A tier stores immutable objects by id. It knows nothing about names, policy or
checksum verification: the store (kvfs.store.objects) decides placement, verifies
chunk checksums of bytes that come back from non-RAM tiers, and records the opaque
``loc`` each ``put`` returns in the LMDB index. All methods that can touch a disk
or the network are async and run blocking work in worker threads; none of them
may block the trio thread.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, AsyncIterator


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one sealed object, handed to ``Tier.put``."""

    oid: int                  # unique, never reused
    size: int                 # bytes
    checksum: int             # xxh3_64 of the whole object
    chunk_size: int           # granularity of chunk_sums
    chunk_sums: tuple[int, ...]  # xxh3_64 of each chunk_size piece (last one may be short)
    key: str = ""             # the object's path when it was placed (self-describing records)
    generation: int = 0       # bumps each time a name gets a new version


@dataclasses.dataclass(frozen=True)
class TierStatistics:
    name: str
    capacity: int
    used: int
    objects: int
    available: bool


class Tier(abc.ABC):
    """A place that holds object bytes. Subclasses: RamTier, NvmeTier, RemoteTier."""

    name: str = "tier"          # "ram", "nvme", "remote": what user.kvfs.tier reports
    volatile: bool = False      # True when contents do not survive a restart
    # True when used/objects come from the index's records (not from what the tier holds):
    # an orphan the start's sweep deletes was never counted (delete(..., counted=False))
    totals_from_records: bool = False

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0           # bytes allocated (subclasses keep this current)
        self.objects = 0

    @property
    def available(self) -> bool:
        """False while the tier cannot be reached (remote target down)."""
        return True

    @property
    def sized(self) -> bool:
        """False while ``capacity`` is not known yet (a remote tier not reached since the mount)."""
        return True

    # Batched durability (the write-down at unmount): while ``defer_sync`` is set, a put
    # may return before its bytes are on stable storage; ``sync_deferred`` makes every such
    # put durable at once. Tiers without a cheaper batch keep syncing each put.
    defer_sync: bool = False

    async def sync_deferred(self) -> None:
        """Make the puts done while ``defer_sync`` was set durable."""

    def free(self) -> int:
        return max(0, self.capacity - self.used)

    def footprint(self, size: int) -> int:
        """Bytes of capacity an object of ``size`` bytes takes (alignment, headers)."""
        return size

    async def open(self) -> None:
        """Acquire resources (directories, connections). Called once before use."""

    async def close(self) -> None:
        """Release resources; pending writes are durable when it returns."""

    async def serve(self) -> None:
        """Background work for the life of the mount (keep-alive, reconnect).

        The store runs it in its nursery after ``open`` and cancels it before
        ``close``. The default has nothing to do and returns at once.
        """

    # ``put`` only slices ``data`` (``data[a:b]``, ``len``): a spilled write buffer is then
    # given as a FileSource, read piece by piece, instead of being copied into memory whole
    puts_from_slices = False

    @abc.abstractmethod
    async def put(self, info: ObjectInfo, data: memoryview) -> bytes:
        """Store ``data`` (exactly info.size bytes) and return an opaque location.

        Durable when it returns unless the tier is volatile. Raises TierFull when
        the footprint does not fit, TierUnavailable when unreachable.
        """

    @abc.abstractmethod
    async def read(self, oid: int, loc: bytes, offset: int, length: int) -> memoryview:
        """Return up to ``length`` bytes at ``offset`` (short only at end of object).

        Raises NoSuchObject if the tier has no such object, TierUnavailable.
        """

    @abc.abstractmethod
    async def delete(self, oid: int, loc: bytes) -> None:
        """Free the object's space. Deleting a missing object is not an error."""

    @abc.abstractmethod
    def scan(self) -> AsyncIterator[tuple[int, bytes, int]]:
        """Yield (oid, loc, size) for every object the tier holds (for fsck)."""

    def backing(self, oid: int, loc: bytes) -> dict[str, Any] | None:
        """Where a fast-path reader can find the bytes: {"path", "offset", "direct"}.

        None when the tier offers no such path (remote). Valid while the caller
        holds the object open through the mount (the store defers frees).
        """
        return None

    def grant_read(self, oid: int, loc: bytes, uid: int) -> dict[str, Any] | None:
        """Like ``backing``, but a location user ``uid`` (a namespace's owner, not the
        daemon's user) can open, made for it (kvfs/store/ownerlinks.py); None when the tier
        offers none. Valid until ``revoke_read`` or the object's deletion."""
        return None

    def revoke_read(self, oid: int, uid: int | None = None) -> None:
        """Take back what ``grant_read`` gave ``uid`` (every user when None)."""

    def granted(self) -> dict[int, set[int]]:
        """Objects with grants: oid -> uids."""
        return {}

    def status(self) -> dict[str, Any]:
        """Extra state for ``kvfs stat`` (remote: connection state, error counts)."""
        return {}

    def statistics(self) -> TierStatistics:
        return TierStatistics(self.name, self.capacity, self.used, self.objects, self.available)
