"""A seal that runs at FUSE_RELEASE (the last writer never flushed, or its flush could not
seal because another writer was open) while other requests for the file arrive: the handler
calls in one trio run, no kernel, so the interleaving is the one named in each test."""
from __future__ import annotations

import errno
import os
import types

import pyfuse3
import pytest
import trio
import trio.testing

from kvfs.build import build_ops
from kvfs.store.index import ROOT_INO
from support.store import open_store

CTX = types.SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)
SIZE = 3 << 20          # hashed in a worker thread: the seal waits, other requests run meanwhile


def content(seed: int, n: int = SIZE) -> bytes:
    block = bytes((seed * 131 + i) % 251 for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path) as kvstore:
        yield build_ops(kvstore, lambda: {"pid": os.getpid()})


async def read_all(ops, fh) -> bytes:
    return bytes(await ops.read(fh, 0, 4 * SIZE))


async def sealed_file(ops, data: bytes) -> int:
    fi, attr = await ops.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def release_sealing(ops, nursery, ino: int, fh: int) -> None:
    """Start the release of ``fh`` (the file's only writer, dirty, never flushed) and return
    once its seal is under way."""
    nursery.start_soon(ops.release, fh)
    while ino not in ops.store.files.writers or ops.store.files.writers[ino].sealing is None:
        await trio.sleep(0)


async def test_opens_during_the_release_seal_get_the_new_version_as_their_own(ops):
    v1, v2 = content(1), content(2)
    ino = await sealed_file(ops, v1)
    w = await ops.open(ino, os.O_RDWR, CTX)
    await ops.write(w.fh, 0, v2)
    got = {}
    async with trio.open_nursery() as n:
        await release_sealing(ops, n, ino, w.fh)

        async def open_as(key, flags):
            got[key] = (await ops.open(ino, flags, CTX)).fh
        n.start_soon(open_as, "reader", os.O_RDONLY)
        n.start_soon(open_as, "writer", os.O_RDWR)
    # the writer that closed was the last: the reader opened after that close and keeps v2
    # while the new writer changes the file (it must not share the buffer being sealed)
    await ops.write(got["writer"], 0, b"X" * 10)
    assert await read_all(ops, got["reader"]) == v2
    await ops.flush(got["writer"])
    await ops.release(got["writer"])
    assert await read_all(ops, got["reader"]) == v2
    await ops.release(got["reader"])
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == b"X" * 10 + v2[10:]
    await ops.release(r.fh)


async def test_a_truncate_during_the_release_seal_is_kept(ops):
    data = content(3)
    fi, attr = await ops.create(ROOT_INO, b"t", 0o644, os.O_WRONLY, CTX)
    ino = attr.st_ino
    await ops.write(fi.fh, 0, data)
    async with trio.open_nursery() as n:
        await release_sealing(ops, n, ino, fi.fh)
        rec = await ops.store.files.setattr(ino, size=1000)      # truncate(2) of the path
    assert rec.size == 1000
    assert ino not in ops.store.files.writers                    # sealed, nothing left open
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == data[:1000]
    await ops.release(r.fh)


async def test_a_reader_that_joined_the_write_reads_it_through_the_release_seal(ops):
    v1, v2 = content(4), content(5)
    ino = await sealed_file(ops, v1)
    w = await ops.open(ino, os.O_RDWR, CTX)
    r = await ops.open(ino, os.O_RDONLY, CTX)             # opened while the writer is open: shares it
    await ops.write(w.fh, 0, v2)
    seen = []
    async with trio.open_nursery() as n:
        await release_sealing(ops, n, ino, w.fh)
        while ino in ops.store.files.writers:                   # every step of the seal and release
            seen.append(await read_all(ops, r.fh))
            await trio.sleep(0)
    seen.append(await read_all(ops, r.fh))
    assert all(s == v2 for s in seen), [len(s) for s in seen]
    await ops.release(r.fh)


async def test_a_rename_during_the_release_seal_is_the_path_the_stored_event_names(ops):
    import json
    sub = ops.store.telemetry.events.subscribe()
    d = await ops.mkdir(ROOT_INO, b"d", 0o755, CTX)
    fi, attr = await ops.create(d.st_ino, b"blk.tmp", 0o644, os.O_WRONLY, CTX)
    await ops.write(fi.fh, 0, content(6))
    async with trio.open_nursery() as n:
        await release_sealing(ops, n, attr.st_ino, fi.fh)
        await ops.rename(d.st_ino, b"blk.tmp", d.st_ino, b"blk", 0, CTX)   # the runtime's rename
    events = [json.loads(line) for line in sub.take(1 << 20).splitlines() if line.strip()]
    stored = [e for e in events if e["event"] == "stored"]
    assert [e["path"] for e in stored] == ["/d/blk"], events


async def truncate_sealing(ops, ino: int) -> None:
    """Until the truncate running in the nursery is sealing ``ino``'s write state."""
    while ino not in ops.store.files.writers or ops.store.files.writers[ino].sealing is None:
        await trio.sleep(0)


async def test_a_writer_opening_while_a_truncate_seals_waits_for_it(ops):
    # a truncate of a file nobody has open seals a write state that never had a writer
    data = content(7)
    ino = await sealed_file(ops, data)
    got = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            async def grow():
                got["rec"] = await ops.store.files.setattr(ino, size=SIZE + 4096)
            n.start_soon(grow)
            await truncate_sealing(ops, ino)
            w = await ops.open(ino, os.O_RDWR, CTX)      # waits until the truncate's seal is done
            assert ino in ops.store.files.writers and ops.store.files.writers[ino].writers == 1
    assert got["rec"].size == SIZE + 4096
    await ops.write(w.fh, 0, b"Y")
    await ops.flush(w.fh)
    await ops.release(w.fh)
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == b"Y" + data[1:] + bytes(4096)
    await ops.release(r.fh)


async def test_a_reader_of_an_old_version_keeps_its_inode_when_the_current_version_is_evicted(ops):
    # a reader holds v1; a write open by the name renews the name (its own inode, with v1: the
    # reader's inode an orphan, docs/design.md "Versions and sizes"); v2 is written on the new
    # inode and evicted. The reader's descriptor goes on like after an unlink (fstat answers,
    # reads give its version)
    v1, v2 = content(8), content(9)
    ino = await sealed_file(ops, v1)
    r = await ops.open(ino, os.O_RDONLY, CTX)             # v1
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.open(ino, os.O_RDWR, CTX)               # renewed: the kernel looks the name up again
    assert e.value.errno == errno.ESTALE
    new = (await ops.lookup(ROOT_INO, b"f", CTX)).st_ino
    assert new != ino
    w = await ops.open(new, os.O_RDWR, CTX)
    await ops.write(w.fh, 0, v2)
    await ops.flush(w.fh)
    await ops.release(w.fh)                               # v2 installed on the new inode
    current = ops.store.ns.sealed.get(new)
    assert current is not None and current.refs == 0
    await ops.store.store.mover.evict(current)
    assert (await ops.getattr(ino, CTX)).st_ino == ino   # not ENOENT
    assert await read_all(ops, r.fh) == v1
    # the old inode has no name: an open through a name the kernel looked up before the
    # renewal reads the version it had then (as an open racing a rename over the name); a
    # change through it is ESTALE (the kernel looks the name up again: a write open used to
    # start an empty buffer on an orphan, fsx long, seed 11 x 4)
    again = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, again.fh) == v1
    await ops.release(again.fh)
    for flags in (os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.open(ino, flags, CTX)
        assert e.value.errno == errno.ESTALE
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.setattr(ino, pyfuse3.EntryAttributes(), pyfuse3.SetattrFields(), None, CTX)
    assert e.value.errno == errno.ESTALE
    assert (await ops.setattr(ino, pyfuse3.EntryAttributes(), pyfuse3.SetattrFields(), r.fh, CTX)).st_ino == ino
    # the name's evicted inode: every request by the name is ESTALE
    for flags in (os.O_RDONLY, os.O_RDWR):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.open(new, flags, CTX)
        assert e.value.errno == errno.ESTALE
    assert ino not in ops.store.files.writers
    await ops.release(r.fh)
    assert ino not in ops.store.ns.orphans and ino not in ops.store.ns.evicted


async def test_requests_for_an_evicted_inode_answer_estale_so_the_kernel_drops_its_name(ops):
    # stat(2) or truncate(2) through a name the kernel still holds after an eviction: ENOENT
    # left that name (and its cached attributes) in the kernel, so a later stat succeeded
    # for a file that was gone; ESTALE makes the kernel look it up again
    ino = await sealed_file(ops, content(10))
    await ops.store.store.mover.evict(ops.store.ns.sealed.get(ino))
    for call in (ops.getattr(ino, CTX), ops.open(ino, os.O_RDONLY, CTX),
                 ops.setattr(ino, pyfuse3.EntryAttributes(), pyfuse3.SetattrFields(), None, CTX)):
        with pytest.raises(pyfuse3.FUSEError) as e:
            await call
        assert e.value.errno == errno.ESTALE



async def test_a_truncate_in_flight_when_the_only_writer_flushes_is_in_the_seal(ops, monkeypatch):
    """A truncate by path of a spilled buffer (its ftruncate runs in a worker thread) in flight
    while the file's only writer closes: the flush's seal waits for it and seals the truncated
    buffer. Found by a concurrent probe (readers, two writers truncating by path and closing,
    passthrough on; tests/fsx/probe_concurrent.py): the seal mapped the buffer at its size
    before the truncate, past the end of its cut file ("flush failed: ValueError: mmap length
    is greater than file size", close gave EIO; a cut under the hash's mapping is a SIGBUS),
    or sealed without a truncate the kernel was then told had happened. The truncate's
    ftruncate is held in its thread (the real call, let go by the test) so that the order is
    this one; it grows the file, so the old code seals a short version rather than fault."""
    import threading
    big, size = content(8, 6 << 20), (6 << 20) + 12345   # over the 4 MiB RAM tier: spilled to NVMe
    gate, real = threading.Event(), os.ftruncate

    def held_ftruncate(fd, n):
        if n == size:
            gate.wait(60)
        return real(fd, n)
    fi, attr = await ops.create(ROOT_INO, b"s", 0o644, os.O_RDWR, CTX)
    ino = attr.st_ino
    await ops.write(fi.fh, 0, big)
    assert ops.store.files.writers[ino].staging.spilled
    monkeypatch.setattr(os, "ftruncate", held_ftruncate)
    got = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            async def truncate():
                got["rec"] = await ops.store.files.setattr(ino, size=size)

            async def close():
                await ops.flush(fi.fh)                       # close(2) of the only writer: seals
                got["flushed"] = True
            n.start_soon(truncate)
            await trio.testing.wait_all_tasks_blocked()      # the truncate is in its thread
            n.start_soon(close)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
    monkeypatch.undo()
    assert got["rec"].size == size and got["flushed"]
    await ops.release(fi.fh)
    assert ino not in ops.store.files.writers
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == big + bytes(size - len(big))
    await ops.release(r.fh)


async def test_a_reader_that_joined_a_truncate_and_closes_during_it_leaves_it_live(ops):
    """A reader opened while a truncate by path runs joins its write state (which has no
    writer); its close during the truncate's seal took the state out of the live ones: the
    daemon then reported the old size and fitted reads to it while the kernel had been told
    the new one (the concurrent probe, one growing file, passthrough off: EOF inside fstat's
    size, SIGBUS in mappings)."""
    data = content(9)
    ino = await sealed_file(ops, data)
    got = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            async def grow():
                got["rec"] = await ops.store.files.setattr(ino, size=SIZE + 5000)
            n.start_soon(grow)
            await truncate_sealing(ops, ino)
            ws = ops.store.files.writers[ino]
            r = await ops.open(ino, os.O_RDONLY, CTX)          # joins the truncate's state
            await ops.release(r.fh)
            assert ops.store.files.writers.get(ino) is ws, "the truncate's state left while it seals"
            assert ops.store.files.live_size(ino, ops.store.ns.inode(ino)) == SIZE + 5000
    assert got["rec"].size == SIZE + 5000 and ino not in ops.store.files.writers
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == data + bytes(5000)
    await ops.release(r.fh)


async def test_a_reader_that_joined_a_last_writers_release_seal_and_closes_during_it_leaves_it_live(ops):
    """The same with the state's last writer: its release (it never flushed) seals a grown
    buffer, a reader joins that state and closes during the seal. The state stays live until
    the release ends (the reader's close took it out: getattr gave the old size while the seal
    ran, and a writer or truncate arriving meanwhile started a second state on the old
    version instead of waiting for this one)."""
    v1, v2 = content(11), content(12, SIZE + 5000)
    ino = await sealed_file(ops, v1)
    w = await ops.open(ino, os.O_RDWR, CTX)
    await ops.write(w.fh, 0, v2)
    got = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await release_sealing(ops, n, ino, w.fh)
            ws = ops.store.files.writers[ino]
            r = await ops.open(ino, os.O_RDONLY, CTX)          # joins the sealing state
            await ops.release(r.fh)
            assert ops.store.files.writers.get(ino) is ws, "the state left while its release seals"
            assert (await ops.getattr(ino, CTX)).st_size == SIZE + 5000

            async def grow():                                  # waits for the seal's end
                got["rec"] = await ops.store.files.setattr(ino, size=SIZE + 9000)
            n.start_soon(grow)
    assert got["rec"].size == SIZE + 9000 and ino not in ops.store.files.writers
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == v2 + bytes(4000)
    await ops.release(r.fh)


@pytest.mark.parametrize("grow", [True, False])
async def test_getattr_during_a_truncate_gives_the_size_the_kernel_keeps_until_its_reply(ops, grow):
    """The kernel keeps an inode's size while a truncate of it is in flight (it ignores the
    attributes of replies meanwhile: FUSE_I_SIZE_UNSTABLE) and cuts cached reads at it, but
    stat(2) shows what a GETATTR reply says. getattr reported the truncate's buffer (the new
    size) before the truncate's reply: a reader's fstat gave it and its pread stopped at the
    old size (the concurrent probe, one file grown by truncate, passthrough on or off: EOF
    inside fstat's size). Until the reply getattr gives the smaller of the two sizes; reads
    are fitted to the new one (a direct_io reader may read past what fstat gave)."""
    data = content(13)
    new = SIZE + 5000 if grow else SIZE - 5000
    ino = await sealed_file(ops, data)
    got = {}
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            async def truncate():
                got["attr"] = await ops.setattr(ino, _size(new), _size_fields(), None, CTX)
            n.start_soon(truncate)
            await truncate_sealing(ops, ino)
            assert (await ops.getattr(ino, CTX)).st_size == min(SIZE, new)
            assert (await ops.lookup(ROOT_INO, b"f", CTX)).st_size == min(SIZE, new)
    assert got["attr"].st_size == new                      # the reply: the new size
    assert (await ops.getattr(ino, CTX)).st_size == new
    assert ino not in ops.store.files.resizing
    r = await ops.open(ino, os.O_RDONLY, CTX)
    assert await read_all(ops, r.fh) == (data + bytes(5000) if grow else data[:new])
    await ops.release(r.fh)


def _size(n: int) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_size = n
    return attr


def _size_fields():
    """The fields of a truncate's SETATTR (pyfuse3.SetattrFields cannot be set from Python)."""
    return types.SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                                 update_gid=False, update_atime=False, update_mtime=False)
