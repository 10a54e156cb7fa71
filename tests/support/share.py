"""Shared-volume test helpers (tests/remote/test_share*.py): object infos, nodes on a file
volume, reads of another node's published blocks, and the share status of a mount."""
from __future__ import annotations

import random
from pathlib import Path

import xxhash

from kvfs.remote import make_volume
from kvfs.remote.share import format as F
from kvfs.remote.share.tier import SharedRemoteTier
from kvfs.store.tier import ObjectInfo

CHUNK = 1 << 20
VOL = 64 << 20


def info_of(oid: int, data: bytes, key: str, gen: int = 1) -> ObjectInfo:
    sums = tuple(xxhash.xxh3_64_intdigest(data[i:i + CHUNK]) for i in range(0, max(len(data), 1), CHUNK))
    return ObjectInfo(oid, len(data), xxhash.xxh3_64_intdigest(data), CHUNK, sums, key, gen)


async def node(path, name: str, *, fmt: bool = False, log_units: int = 256) -> SharedRemoteTier:
    t = SharedRemoteTier(make_volume(str(path), create_size=VOL), instance_id=name, format=fmt, max_nodes=4,
                         settle=0.01, log_units=log_units)
    await t.open()
    return t


async def foreign_read(b: SharedRemoteTier, path: str) -> bytes:
    p = b.view.get(path)
    assert p is not None, f"{path} not in the view"
    loc = F.pack_foreign_loc(p.slot, p.entry)
    return bytes(await b.read(999, loc, 0, p.entry.size))


MiB = 1 << 20


def content(i: int, v: int = 0) -> bytes:
    return random.Random(f"share-{i}-{v}").randbytes(MiB)


def outcome(path: Path) -> bytes | int:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        return e.errno


def share(m) -> dict:
    return m.stats()["tiers"]["remote"]["share"]


def caught_up(b, a) -> bool:
    """B has applied every entry A has appended to its log."""
    sa, sb = share(a), share(b)
    peer = sb["tail"]["peers"].get(sa["node_id"])
    return peer is not None and peer["next_seq"] >= sa["log_next_seq"]
