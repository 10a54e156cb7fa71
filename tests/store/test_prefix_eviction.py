"""Prefix-aware eviction: a kvfs block is not evicted while cached descendants remain,
so chains lose their tail, never their head. Real tiers, real LMDB, no kernel."""
from __future__ import annotations

import os

from kvfs.store.index import ROOT_INO
from support.store import PAYLOAD, block, hx, open_store  # noqa: F401


async def write(kvstore, name: bytes, data: bytes) -> None:
    fh, _, _ = await kvstore.files.create(ROOT_INO, name, 0o644, 0, 0)
    await kvstore.files.write(fh, 0, data)
    await kvstore.files.release(fh)
    await kvstore.store.mover.relieve()


def exists(kvstore, name: bytes) -> bool:
    return kvstore.index.lookup(ROOT_INO, name) is not None


async def test_heads_outlive_tails(tmp_path):
    async with open_store(tmp_path, ram=256 << 10, nvme=1 << 20) as kvstore:
        head = [hx(f"head{i}") for i in range(4)]
        # the shared head, written first (so plain LRU would evict it first) ...
        for i, h in enumerate(head):
            await write(kvstore, f"{h}.kv".encode(), block("ns", h, head[i - 1] if i else "", 16 * (i + 1)))
        ino = kvstore.index.lookup(ROOT_INO, f"{head[1]}.kv".encode())
        assert kvstore.xattrs.get(ino, b"user.kvfs.parent").decode() == head[0]
        assert kvstore.xattrs.get(ino, b"user.kvfs.tokens") == b"32"
        # ... then three prompts that extend it, then enough plain files to force eviction
        tails = []
        for p in range(3):
            parent = head[-1]
            for j in range(3):
                h = hx(f"p{p}t{j}")
                await write(kvstore, f"{h}.kv".encode(), block("ns", h, parent, 16 * (5 + j)))
                tails.append((h, parent))
                parent = h
        def check_closed():
            for h, parent in tails:
                if exists(kvstore, f"{h}.kv".encode()):
                    assert exists(kvstore, f"{parent}.kv".encode()), f"{h} outlived its parent"
        k = 0
        while all(exists(kvstore, f"{h}.kv".encode()) for h, _ in tails):
            await write(kvstore, b"plain%d" % k, os.urandom(PAYLOAD))
            k += 1
            assert k < 100, "pressure never evicted a tail block"
            check_closed()
        # the first blocks to go are tails, although the head is older in LRU order
        assert kvstore.store.counters["nvme"].evictions > 0
        assert all(exists(kvstore, f"{h}.kv".encode()) for h in head), "the shared head was evicted"
        # keep the pressure on: chains shrink from the tail, always prefix-closed
        for _ in range(30):
            await write(kvstore, b"plain%d" % k, os.urandom(PAYLOAD))
            k += 1
            check_closed()
            if exists(kvstore, f"{head[0]}.kv".encode()):
                continue
            assert not any(exists(kvstore, f"{h}.kv".encode()) for h in head + [t for t, _ in tails])
        # plain files keep plain LRU: the oldest went first, the newest is there
        assert not exists(kvstore, b"plain0") and exists(kvstore, b"plain%d" % (k - 1))
