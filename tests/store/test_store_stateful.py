"""The store against a plain dict model, with tiny tiers so that demotion, promotion
and eviction happen all the time. Real tmpfs, a real directory, real LMDB; no kernel.

Allowed divergence: an unpinned file may disappear (eviction, or a crash that lost a
RAM-only object) -- a cache miss. Never allowed: wrong bytes, a pinned file lost
while the daemon runs, a tier over its capacity below RAM.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfs.build import build_kvstore
from kvfs.config import Config
from kvfs.errors import NamespaceError, StoreError, TierFull
from kvfs.store.index import ROOT_INO, Index
from kvfs.store.nvme import NvmeTier
from kvfs.store.ram import RamTier

NAMES = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f.kv", b"g"])
SIZES = st.sampled_from([0, 1, 4095, 4096, 20_000, 70_000, 150_000])
RAM, NVME, CHUNK = 256 << 10, 1 << 20, 16 << 10


def payload(seed: int, size: int) -> bytes:
    return (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvfs-sm-"))
        self.model: dict[bytes, bytes] = {}
        self.pinned: set[bytes] = set()
        self.seed = 0
        self._open()

    # ---- lifecycle --------------------------------------------------------
    def _open(self) -> None:
        async def build():
            index = Index(self.dir / "state")
            tiers = [RamTier(RAM, "/dev/shm", index.instance_id), NvmeTier(NVME, self.dir / "nvme")]
            for t in tiers:
                await t.open()
            cfg = Config(chunk_size=CHUNK, high_watermark=0.8, low_watermark=0.5, promote_hits=2)
            kvstore = build_kvstore(cfg, index, tiers)
            await kvstore.start()
            return kvstore
        self.kvstore = trio.run(build)
        self.store = self.kvstore.store

    def _close(self, clean: bool) -> None:
        async def down():
            if clean:
                self.store.flush_stats()
                await self.store.mover.write_down_volatile()
            for t in self.store.tiers:
                await t.close()
            self.kvstore.index.close()
        trio.run(down)

    def teardown(self):
        self._close(clean=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, fn, *args):
        async def main():
            return await fn(*args)
        return trio.run(main)

    # ---- helpers ------------------------------------------------------------
    def _ino(self, name: bytes) -> int | None:
        return self.kvstore.index.lookup(ROOT_INO, name)

    async def _write(self, name: bytes, data: bytes, append: bool) -> None:
        ino = self._ino(name)
        if ino is None:
            fh, _, _ = await self.kvstore.files.create(ROOT_INO, name, 0o644, 0, 0)
        else:
            fh = await self.kvstore.files.open(ino, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
        try:
            # the kernel resolves O_APPEND offsets from i_size before it sends the write
            base = self.kvstore.files.getattr(self._ino(name)).size if append and ino is not None else 0
            half = len(data) // 2
            await self.kvstore.files.write(fh, base, data[:half])
            await self.kvstore.files.write(fh, base + half, data[half:])
            await self.kvstore.files.flush(fh)
        finally:
            await self.kvstore.files.release(fh)

    async def _read(self, name: bytes) -> bytes:
        ino = self._ino(name)
        if ino is None:
            raise NamespaceError(errno.ENOENT)
        fh = await self.kvstore.files.open(ino, os.O_RDONLY)
        try:
            out, off = [], 0
            size = self.kvstore.files.getattr(ino).size
            while off < size:
                part = bytes(await self.kvstore.files.read(fh, off, 50_000))
                if not part:
                    break
                out.append(part)
                off += len(part)
            return b"".join(out)
        finally:
            await self.kvstore.files.release(fh)

    def _forget_missing(self) -> None:
        """Names the store dropped (eviction): the model follows; pinned ones must stay."""
        for name in list(self.model):
            if self._ino(name) is None:
                assert name not in self.pinned, f"pinned {name!r} was lost"
                del self.model[name]

    # ---- rules --------------------------------------------------------------
    @rule(name=NAMES, size=SIZES)
    def write(self, name, size):
        self.seed += 1
        data = payload(self.seed, size)
        try:
            self.run(self._write, name, data, False)
        except TierFull:
            # ENOSPC: only when what remains is pinned; the old version (if any) stays
            assert self.pinned, "ENOSPC although nothing is pinned"
            self._forget_missing()
            return
        self.model[name] = data
        self._forget_missing()

    @rule(name=NAMES, size=st.sampled_from([1, 5000]))
    def append(self, name, size):
        if name not in self.model:
            return
        self.seed += 1
        data = payload(self.seed, size)
        try:
            self.run(self._write, name, data, True)
        except TierFull:
            assert self.pinned
            self._forget_missing()
            return
        self._forget_missing()
        if name in self.model:
            self.model[name] = self.model[name] + data

    @rule(name=NAMES)
    def read(self, name):
        try:
            got = self.run(self._read, name)
        except (NamespaceError, StoreError) as e:
            assert name not in self.model or name not in self.pinned, f"pinned {name!r}: {e}"
            self.model.pop(name, None)
            return
        assert name in self.model, f"{name!r} exists but the model never wrote it"
        assert got == self.model[name], f"wrong bytes for {name!r}"

    @rule(src=NAMES, dst=NAMES)
    def rename(self, src, dst):
        try:
            self.run(self.kvstore.names.rename, ROOT_INO, src, ROOT_INO, dst, 0)
        except NamespaceError as e:
            assert e.errno == errno.ENOENT and src not in self.model
            return
        if src != dst:
            self.model[dst] = self.model.pop(src)
            self.pinned.discard(dst)
            if src in self.pinned:
                self.pinned.discard(src)
                self.pinned.add(dst)

    @rule(name=NAMES)
    def delete(self, name):
        try:
            self.run(self.kvstore.names.unlink, ROOT_INO, name)
        except NamespaceError as e:
            assert e.errno == errno.ENOENT
        self.model.pop(name, None)
        self.pinned.discard(name)

    @rule(name=NAMES, on=st.booleans())
    def pin(self, name, on):
        ino = self._ino(name)
        if ino is None:
            return
        self.kvstore.xattrs.set(ino, b"user.kvfs.pin", b"1" if on else b"0")
        (self.pinned.add if on else self.pinned.discard)(name)

    @rule()
    def relieve(self):
        self.run(self.store.mover.relieve)
        self._forget_missing()

    @rule()
    def promote_pending(self):
        async def drain():
            while True:
                try:
                    obj = self.store._promote_recv.receive_nowait()
                except trio.WouldBlock:
                    return
                await self.store.mover.promote(obj)
        self.run(drain)
        self._forget_missing()

    @rule()
    def restart(self):
        self._close(clean=True)
        self._open()
        self._forget_missing()

    @precondition(lambda self: not self.pinned)
    @rule()
    def crash(self):
        # kill -9: no write-down; RAM-only objects vanish, everything else must be exact
        self._close(clean=False)
        self._open()
        self._forget_missing()

    # ---- invariants -----------------------------------------------------------
    @invariant()
    def visible_files_match_the_model(self):
        names = {n for _, n, _ in self.kvstore.index.readdir(ROOT_INO, 0)}
        assert names <= set(self.model) | set(), f"unexpected names {names - set(self.model)}"

    @invariant()
    def running_totals_match_the_records(self):
        # what a start after a crash takes instead of decoding every record (kvfs.store.tally)
        tally = self.store.tally
        assert tally.current() == tally.recount(rec for _oid, rec in self.kvstore.index.iter_objects())

    @invariant()
    def durable_tier_within_capacity(self):
        nvme = self.store.tiers[1]
        assert nvme.used <= nvme.capacity
        assert nvme.used == sum(nvme.footprint(o.size) for o in self.store.objs.values() if "nvme" in o.place)


TestStore = StoreMachine.TestCase
TestStore.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
