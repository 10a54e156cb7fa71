"""Issue 11 item 12: a read-ahead of an object deleted meanwhile is not a checksum failure."""
from __future__ import annotations

import os

import trio
import trio.testing

from support.store import open_store

from kvfs.store.index import ROOT_INO


async def _sealed_on_nvme(kvstore, name: bytes, data: bytes):
    fh, ino, _ = await kvstore.files.create(ROOT_INO, name, 0o644, 0, 0, os.O_WRONLY)
    await kvstore.files.write(fh, 0, data)
    await kvstore.files.release(fh)
    obj = kvstore.ns.sealed[ino]
    await kvstore.store.mover.demote(obj, 0)
    assert set(obj.place) == {"nvme"}
    return obj


async def test_read_ahead_of_a_deleted_object_is_not_a_checksum_failure(tmp_path, caplog):
    async with open_store(tmp_path) as kvstore:
        store = kvstore.store
        nvme = store.tiers[1]
        data = os.urandom(4 * store.chunk_size)
        obj = await _sealed_on_nvme(kvstore, b"f", data)
        assert bytes(await store.reads.read(obj, 0, 10)) == data[:10]
        await kvstore.names.unlink(ROOT_INO, b"f")          # its bytes are freed at once (not open)
        await store.reads.prefetch(obj, nvme, 2)          # a read-ahead whose turn comes now
        assert store.counters["nvme"].checksum_failures == 0
        assert "checksum mismatch" not in caplog.text


async def test_read_of_a_copy_deleted_under_it_is_not_counted_as_corrupt(tmp_path, caplog):
    async with open_store(tmp_path) as kvstore:
        store = kvstore.store
        nvme = store.tiers[1]
        obj = await _sealed_on_nvme(kvstore, b"g", os.urandom(3 * store.chunk_size))
        obj.refs += 1                                # a reader holds it
        await kvstore.names.unlink(ROOT_INO, b"g")
        obj.refs -= 1
        await store.release_space(obj)              # the reader closed: bytes freed
        try:
            await store.reads.fetch_chunk(obj, nvme, 1)   # a fetch that was already on its way
        except Exception as e:                      # noqa: BLE001
            assert type(e).__name__ == "NoSuchObject", e
        assert store.counters["nvme"].checksum_failures == 0
        assert "checksum mismatch" not in caplog.text


async def _read_ahead_done(store) -> None:
    """Every read-ahead task has started and its fetch (in a worker thread) has ended."""
    await trio.testing.wait_all_tasks_blocked()
    while store.reads.inflight:
        await next(iter(store.reads.inflight.values())).wait()
        await trio.testing.wait_all_tasks_blocked()


async def test_read_ahead_runs_in_the_served_store_and_not_after_it_stops(tmp_path):
    """Read-ahead starts in ``ObjectStore.serve``'s nursery: while served, a read of chunk 0
    brings the next chunks in; once serve is cancelled (shutdown), a read fetches only what
    it asked for and nothing is left running."""
    async with open_store(tmp_path) as kvstore:
        store = kvstore.store
        obj = await _sealed_on_nvme(kvstore, b"h", os.urandom(8 * store.chunk_size))
        async with trio.open_nursery() as nursery:
            await nursery.start(store.serve)
            assert bytes(await store.reads.read(obj, 0, 10))
            await _read_ahead_done(store)
            assert {(obj.oid, i) for i in range(1, 4)} <= set(store.reads.chunks), sorted(store.reads.chunks)
            nursery.cancel_scope.cancel()
        store.reads.chunks.clear()
        assert bytes(await store.reads.read(obj, 5 * store.chunk_size, 10))
        await _read_ahead_done(store)
        assert set(store.reads.chunks) == {(obj.oid, 5)}
        assert not store.reads.inflight
