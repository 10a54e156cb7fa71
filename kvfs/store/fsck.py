"""Offline consistency check of a kvfs state directory: one check per invariant.

Runs with the mount down (it takes the state directory's lock). Each check
reports problems as one-line strings; with ``repair`` it fixes what it found by
dropping what cannot be trusted (a cache may lose entries, never serve wrong bytes).
``rebuild_remote`` re-creates index entries for objects found on the remote
volume (self-describing records) that the index does not know, under their
recorded paths.

A damaged index (missing while its header exists, truncated, of an unknown format,
or holding a record that does not parse) is reported as one problem; with ``repair``
it is moved aside (``index.lmdb.damaged-<time>``) and rebuilt from the objects'
own records on the NVMe tier (and the remote tier when configured), under the
paths they had when they were written down.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable

import trio

from kvfs.errors import IndexDamaged, NamespaceError, StoreError
from kvfs.store import checksum, nvmerecord, records, tally
from kvfs.store.index import ENV_NAME, HEADER_NAME, ROOT_INO, Index
from kvfs.store.objects import Obj
from kvfs.store.records import InodeRecord

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What fsck checks, built by its caller (kvfs.build.fsck_layout): the state directory,
    the NVMe tier's directory, and the durable tiers over an index (built, not opened; RAM is
    volatile: nothing to check offline)."""
    state_dir: Path
    nvme_dir: Path
    tiers: Callable[[Index], list]


@dataclasses.dataclass
class FsckReport:
    problems: list[str] = dataclasses.field(default_factory=list)
    repaired: int = 0
    checked_objects: int = 0
    rebuilt: int = 0


def run_fsck(layout: Layout, *, repair: bool = False, rebuild_remote: bool = False,
             progress: Progress | None = None) -> FsckReport:
    return trio.run(_fsck, layout, repair, rebuild_remote, progress or (lambda d, t, w: None))


async def _fsck(layout: Layout, repair: bool, rebuild_remote: bool, progress: Progress) -> FsckReport:
    report = FsckReport()
    index = None
    try:
        index = Index(layout.state_dir)
        index.verify_records()
    except IndexDamaged as e:
        if index is not None:
            index.close()
        _problem(report, f"index damaged: {e}")
        if not repair:
            return report
        index = await _rebuild_index(layout, report, progress)
    tiers = layout.tiers(index)
    opened = []
    try:
        for t in tiers:
            await t.open()
            opened.append(t)
        tiers[0].bind(index.instance_id, layout.state_dir)
        by_name = {t.name: t for t in tiers}
        if rebuild_remote:
            if "remote" not in by_name:
                raise StoreError("--rebuild-remote needs a remote tier (--remote URL)")
            await _rebuild(index, by_name["remote"], report, progress)
        _check_names(index, report, repair)
        await _check_objects(index, by_name, report, repair, progress)
        await _check_orphans(index, tiers, report, repair, progress)
        await _check_leftovers(tiers, report, repair)
        _check_foreign(tiers, report)
        _check_totals(index, by_name, report, repair)
    finally:
        for t in opened:
            await t.close()
        index.close()
    return report


def _problem(report: FsckReport, msg: str) -> None:
    log.warning("fsck: %s", msg)
    report.problems.append(msg)


def _check_names(index: Index, report: FsckReport, repair: bool) -> None:
    """Every name points at an inode; every inode but the root is named by its parent."""
    inodes = dict(index.iter_inodes())
    objects = {oid for oid, _ in index.iter_objects()}
    bad_dirents, named = [], set()
    for parent, name, child in index.iter_dirents():
        if child not in inodes or parent not in inodes:
            bad_dirents.append((parent, name))
            _problem(report, f"name {name!r} in directory {parent} points at missing inode {child}")
        else:
            named.add(child)
    bad_inodes = []
    for ino, rec in inodes.items():
        if ino == ROOT_INO:
            continue
        if ino not in named:
            bad_inodes.append(ino)
            _problem(report, f"inode {ino} ({rec.name!r}) has no name")
        elif stat.S_ISREG(rec.mode) and rec.oid not in objects:
            bad_inodes.append(ino)
            bad_dirents.append((rec.parent, rec.name))
            _problem(report, f"file {rec.name!r} (inode {ino}) has no sealed object")
    if repair and (bad_dirents or bad_inodes):
        with index.write() as txn:
            for p, n in bad_dirents:
                txn.unlink(p, n)
            for ino in bad_inodes:
                txn.del_inode(ino)
        report.repaired += len(set(bad_dirents)) + sum(1 for ino in bad_inodes if ino not in named)


def _check_totals(index: Index, tiers: dict, report: FsckReport, repair: bool) -> None:
    """The unsealed and RAM-only sets and the running totals a start after a crash reads
    (kvfs.store.tally) agree with the records; repaired by forgetting the totals (the next
    start recovers in full and recounts them)."""
    problems = tally.check(index, {name: t.footprint for name, t in tiers.items()})
    for msg in problems:
        _problem(report, msg)
    if repair and problems:
        tally.invalidate(index)
        report.repaired += 1


async def _check_objects(index: Index, tiers: dict, report: FsckReport, repair: bool,
                         progress: Progress) -> None:
    """Every object is owned by one file and each durable copy is there and verifies."""
    owners = {rec.oid: ino for ino, rec in index.iter_inodes() if stat.S_ISREG(rec.mode)}
    objs = list(index.iter_objects())
    drop: list[tuple[int, int | None]] = []
    for n, (oid, rec) in enumerate(objs):
        progress(n, len(objs), "checksums")
        obj = Obj.from_record(oid, rec)
        report.checked_objects += 1
        if oid not in owners:
            _problem(report, f"object {oid:x} ({obj.key}) is not owned by any file")
            drop.append((oid, None))
            continue
        durable = {k: v for k, v in obj.place.items() if k in tiers}
        if obj.size and not durable:
            _problem(report, f"object {oid:x} ({obj.key}) has no durable copy")
            drop.append((oid, owners[oid]))
            continue
        for name, loc in durable.items():
            why = await _verify(tiers[name], obj, loc)
            if why:
                _problem(report, f"object {oid:x} ({obj.key}) on {name}: {why}")
                drop.append((oid, owners[oid]))
                break
    progress(len(objs), len(objs), "checksums")
    if repair and drop:
        with index.write() as txn:
            for oid, ino in drop:
                rec = txn.get_object(oid)
                txn.del_object(oid)
                if ino is not None:
                    irec = txn.get_inode(ino)
                    if irec is not None:
                        txn.unlink(irec.parent, irec.name)
                        txn.del_inode(ino)
                if rec:
                    for name, loc in rec.place.items():
                        if name in tiers:
                            await tiers[name].delete(oid, loc)
        report.repaired += len(drop)


async def _verify(tier, obj: Obj, loc: bytes) -> str | None:
    cs = obj.chunk_size
    for i, want in enumerate(obj.sums):
        length = min(cs, obj.size - i * cs)
        try:
            data = bytes(await tier.read(obj.oid, loc, i * cs, length))
        except StoreError as e:
            return f"unreadable ({e})"
        if len(data) != length:
            return f"short ({len(data)} of {length} bytes at chunk {i})"
        if checksum.digest(data) != want:
            return f"checksum mismatch at chunk {i}"
    return None


async def _check_orphans(index: Index, tiers: list, report: FsckReport, repair: bool,
                         progress: Progress) -> None:
    """Every backing object is known to the index."""
    known = {oid: rec for oid, rec in index.iter_objects()}
    for tier in tiers:
        if not tier.available:
            continue
        orphans = []
        async for oid, loc, size in tier.scan():
            rec = known.get(oid)
            if rec is None or tier.name not in rec.place:
                orphans.append((oid, loc))
        for oid, loc in orphans:
            _problem(report, f"orphaned backing object {oid:x} on {tier.name}")
            if repair:
                await tier.delete(oid, loc)
                report.repaired += 1
        progress(1, 1, f"orphans on {tier.name}")


async def _check_leftovers(tiers: list, report: FsckReport, repair: bool) -> None:
    """No NVMe shard holds a temporary object file or a record side file without its object
    file (what a put cut off by a crash leaves: kvfs.store.nvmerecord)."""
    for tier in tiers:
        if not tier.available or not hasattr(tier, "leftovers"):
            continue
        for shard, name in await trio.to_thread.run_sync(tier.leftovers):
            _problem(report, f"leftover file {name} of an unfinished write on {tier.name}")
            if repair:
                nvmerecord.remove_side(shard, name)
                report.repaired += 1


def _check_foreign(tiers: list, report: FsckReport) -> None:
    """Nothing the daemon does not make was in its directories (opening a tier empties its
    staging and grants directories, without recursion: kvfs.store.safedir.clear_dir)."""
    for tier in tiers:
        for msg in getattr(tier, "foreign", ()):
            _problem(report, msg)
            report.repaired += 1


async def _rebuild_index(layout: Layout, report: FsckReport, progress: Progress) -> Index:
    """Move the damaged index aside and rebuild it from the tiers' own object records."""
    from kvfs.store.nvme import NvmeTier
    nvme = NvmeTier(0, layout.nvme_dir)
    await nvme.open()
    try:
        instance = nvme.recorded_instance()
    finally:
        await nvme.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (ENV_NAME, HEADER_NAME):
        src = layout.state_dir / name
        if src.exists() or src.is_symlink():
            os.rename(src, layout.state_dir / f"{name}.damaged-{stamp}")
    if instance is None:
        header = layout.state_dir / f"{HEADER_NAME}.damaged-{stamp}"
        try:
            instance = records.decode_meta(header.read_bytes()).get("instance")
        except (OSError, IndexDamaged):
            instance = None
    index = Index(layout.state_dir, instance=instance if isinstance(instance, str) else None)
    log.warning("fsck: damaged index moved aside (*.damaged-%s); rebuilding instance %s",
                stamp, index.instance_id)
    tiers = layout.tiers(index)
    opened = []
    try:
        for t in tiers:
            await t.open()
            opened.append(t)
        for t in tiers:
            if t.available and hasattr(t, "scan_records"):
                await _rebuild(index, t, report, progress)
    finally:
        for t in opened:
            await t.close()
    report.repaired += 1
    return index


async def _rebuild(index: Index, remote, report: FsckReport, progress: Progress) -> None:
    """Re-create index entries for a tier's object records the index lacks, at their
    recorded paths (the remote volume's records, or the NVMe files' own records)."""
    known = {oid for oid, _ in index.iter_objects()}
    async for info, loc in remote.scan_records(lambda d, t: progress(d, t, f"scanning {remote.name}")):
        if info.oid in known or not info.key:
            continue
        comps = [c.encode("utf-8", "surrogateescape") for c in info.key.strip("/").split("/") if c]
        if not comps:
            continue
        now = time.time_ns()
        with index.write() as txn:
            parent = ROOT_INO
            for c in comps[:-1]:
                child = txn.lookup(parent, c)
                if child is None:
                    child = txn.new_id(b"ino")
                    txn.put_inode(child, InodeRecord(mode=stat.S_IFDIR | 0o755, uid=0, gid=0, size=0, nlink=1,
                                                     atime=now, mtime=now, ctime=now, parent=parent, name=c,
                                                     xattrs={}))
                    txn.link(parent, c, child)
                elif not stat.S_ISDIR(txn.get_inode(child).mode):
                    raise NamespaceError(20, f"cannot rebuild {info.key}: {c!r} is not a directory")
                parent = child
            if txn.lookup(parent, comps[-1]) is not None:
                continue                      # a newer file holds the name
            ino = txn.new_id(b"ino")
            obj = Obj(info.oid, info.size, info.checksum, info.chunk_size, tuple(info.chunk_sums),
                      {remote.name: loc}, ino, info.key, info.generation)
            txn.put_object(info.oid, obj.record())
            txn.put_inode(ino, InodeRecord(mode=stat.S_IFREG | 0o644, uid=0, gid=0, size=info.size, nlink=1,
                                           atime=now, mtime=now, ctime=now, parent=parent, name=comps[-1],
                                           xattrs={}, oid=info.oid, gen=info.generation))
            txn.link(parent, comps[-1], ino)
        known.add(info.oid)
        report.rebuilt += 1
    log.info("rebuilt %d index entries from the %s tier", report.rebuilt, remote.name)
