"""fsx-style random-operation exerciser: a kvfs mount and a plain reference directory in lockstep.

Each worker (a process of its own) owns one subdirectory ``w<k>`` on both sides and a fixed
set of names in it, and applies one seeded random sequence of operations to both: open (with
random access modes, O_CREAT, O_TRUNC, O_APPEND, O_DIRECT), close, pread, pwrite, append,
ftruncate, truncate by path, rename (over existing names too), unlink (also while open),
stat/fstat, readdir, mmap read, mmap write + msync, posix_fallocate, xattrs, utime, fsync,
O_DIRECT aligned reads and writes. Every result is compared: the bytes of every read, sizes
(fstat, stat, readdir), xattr values and lists, and errors (errno). Workers never share a
file, so the lockstep stays exact with N processes.

The reference models kvfs's documented semantics where they are not POSIX (docs/design.md):

* Versions. A read-only descriptor opened while no writer has the file open reads the sealed
  version it opened, even after a new version is written (the file is opened for writing, or
  truncated by path). In the reference such a descriptor is moved onto a private snapshot copy
  of the file when the next write session of that inode starts (and keeps a descriptor of the
  file itself: its size). A read-only descriptor opened while writers are open shares their
  buffer (POSIX), and keeps the version they seal. Such an older version's descriptor is told
  the file's current size (the kernel keeps one per inode) and its read, pread, O_DIRECT read
  and mmap must agree with it exactly: the snapshot's bytes, zeros past their end, EOF at the
  current size (docs/design.md, "Versions and sizes"); never EOF or SIGBUS inside that size.
* mmap reads map ``fstat``'s size and read up to its last byte (a SIGBUS kills the worker:
  the parent reports the signal).
* Eviction. A file that is neither open nor pinned may vanish (ENOENT) under pressure: on
  ENOENT from kvfs for a closed file, the reference drops it too (counted as ``evicted``). A
  name recreated by O_CREAT after an unnoticed eviction is recognised by its new inode number.
* ``mmap`` of a handle opened while another version of the inode is open gives ENODEV on kvfs
  (``direct_io`` handles): counted as ``mmap_enodev``, not a mismatch. Since the kernel sends
  FUSE_RELEASE after ``close(2)`` returns, a handle of the inode closed earlier may still count
  as open, so ENODEV is accepted for any inode that had another handle open or closed before.
* kvfs's own read-only ``user.kvfs.*`` attributes are left out of xattr lists.
* O_DIRECT: if the reference filesystem refuses it, the reference does the same I/O buffered.
* ``posix_fallocate``: kvfs has no FALLOCATE (pyfuse3 3.5), so glibc emulates it; where the
  emulation gives EBADF (O_APPEND; O_WRONLY over existing bytes) kvfs must give exactly that
  and the reference does nothing (counted as ``fallocate_ebadf``).

Crash phases (``Exerciser.pause``/``verify_after_crash``): the parent waits until the daemon
has processed every FUSE_RELEASE (asynchronous in the kernel: see ``Exerciser.pause``), then
kill -9s the daemon and remounts; then every file must hold exactly its last sealed version (the
reference content when no writer had it open, else its content when the write session began
or when its only writer called fsync/msync or closed another descriptor of the same open file —
Python's mmap closes the dup it maps — which seal) or be absent. The reference is then set to
what kvfs kept. ``FSX_HISTORY=N`` in the environment shows N earlier checks per mismatch.

Run it from the command line on a mount you made yourself (``--tiers`` prints the tier sizes
a run of that seed mounts with: ``tier_sizes``, as tests/fsx/test_fsx.py does)::

    python tests/support/fsx.py MOUNT_DIR REF_DIR --seed 1 --ops 20000 --procs 4
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import random
import shutil
import stat
import sys
import time

PAGE = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

# Operation kinds with bugs known and being fixed elsewhere (issue 11). Each kind stays in the
# exerciser and runs by default; a run (the default-suite test) may exclude these until the
# fixes are merged. The integrator empties this set after merging them.
# Operation kinds a run may leave out (``--exclude-known-broken``) while bugs in them are being
# fixed. Empty: every issue-11 bug is fixed, and the one documented limit (fallocate) is
# modelled (``Worker._fallocate``).
KNOWN_BROKEN: set = set()

ALL_KINDS = [
    "open", "close", "pread", "pwrite", "append", "ftruncate", "truncate", "rename", "unlink",
    "stat", "fstat", "readdir", "mmap_read", "mmap_write", "fallocate", "xattr", "utime",
    "fsync", "odirect", "read_file", "bulk_write",
    # variants that reach the code paths of the issue-11 bugs (and the fallocate limit)
    "mmap_write_append", "readdir_while_writing", "old_version_reader", "unlink_while_open",
    "utime_while_writing", "fallocate_wronly", "rdonly_creat",
]
WEIGHTS = {"open": 14, "close": 10, "pread": 14, "pwrite": 12, "append": 5, "ftruncate": 4,
           "truncate": 2, "rename": 4, "unlink": 3, "stat": 5, "fstat": 5, "readdir": 2,
           "mmap_read": 4, "mmap_write": 4, "fallocate": 2, "xattr": 4, "utime": 2, "fsync": 2,
           "odirect": 3, "read_file": 5, "bulk_write": 2}


def tier_sizes(seed: int) -> dict:
    """The tier sizes of a run's mount, picked at random per seed (what a version's reads
    answer must not depend on them): RAM log-uniform from 4 MiB to 1 GiB, NVMe 16 to 256 MiB
    (small ones make demotion, spilling and eviction run during the sequence)."""
    rng = random.Random(f"fsx-tiers-{seed}")
    ram = max(4, min(1024, round(4 * 2 ** rng.uniform(0, 8))))
    return {"ram": f"{ram}MiB", "nvme_size": f"{rng.choice([16, 32, 64, 256])}MiB"}


@dataclasses.dataclass
class Config:
    kvfs_dir: str
    ref_dir: str
    seed: int = 1
    ops: int = 2000
    procs: int = 1
    files: int = 40              # names per worker
    max_size: int = 768 << 10    # offsets of writes stay below this
    max_io: int = 48 << 10
    max_open: int = 4            # descriptors per worker
    exclude: tuple = ()          # op kinds left out of the random choice
    max_mismatches: int = 200    # a worker stops after this many (they cascade once sides diverge)
    history: int = int(os.environ.get("FSX_HISTORY", "0"))  # > 0: each mismatch lists this many earlier checks of its file
    posix: bool = False          # model plain POSIX (no old versions): to check the exerciser on two POSIX dirs
    passthrough: bool = False    # the mount serves sealed readers by FUSE passthrough (reported)


@dataclasses.dataclass
class Handle:
    name: str                    # the name it was opened by (may be renamed or unlinked since)
    kfd: int
    rfd: int
    acc: int
    append: bool
    direct: bool
    rino: int                    # reference inode: the file's identity
    frozen: bool = False         # the reference side reads a private snapshot (old version)
    maybe_direct_io: bool = False   # kvfs may have opened it direct_io (mmap gives ENODEV)
    snap: str | None = None
    live: int | None = None      # frozen: the reference's descriptor of the file itself (its size)


class Mismatch(Exception):
    pass


def _call(fn, *a, **kw):
    try:
        return True, fn(*a, **kw)
    except OSError as e:
        return False, e.errno


def _ename(r) -> str:
    ok, v = r
    if ok:
        return f"ok({v!r})" if not isinstance(v, (bytes, bytearray)) or len(v) < 64 else f"ok(<{len(v)} bytes>)"
    return errno.errorcode.get(v, str(v))


class Worker:
    """One worker's lockstep run over ``w<k>`` on both sides."""

    def __init__(self, cfg: Config, k: int):
        self.cfg, self.k = cfg, k
        self.rng = random.Random(f"fsx-{cfg.seed}-{k}")
        self.kd = os.path.join(cfg.kvfs_dir, f"w{k}")
        self.rd = os.path.join(cfg.ref_dir, f"w{k}")
        self.snapdir = os.path.join(cfg.ref_dir, f".snap{k}")
        for d in (self.kd, self.rd, self.snapdir):
            os.makedirs(d, exist_ok=True)
        self.names = [f"f{i:02d}" for i in range(cfg.files)]
        self.handles: list[Handle] = []
        self.kino: dict[str, int] = {}            # last kvfs inode seen per name
        # rino -> the versions a crash may leave while its write session runs: the sealed content
        # when the session began (None: none, the file was created in it), then each fsync's
        self.session_start: dict[int, list] = {}
        self.counts = collections.Counter()
        self.mismatches: list[str] = []
        self.kinds = [k_ for k_ in WEIGHTS if k_ not in cfg.exclude]
        self.variants = [v for v in ALL_KINDS if v not in WEIGHTS and v not in cfg.exclude]
        self.buf = mmap.mmap(-1, cfg.max_io + 2 * PAGE)       # page aligned, for O_DIRECT
        self.ref_direct = self._probe_ref_direct()
        self.nsnap = 0
        self.op_no = 0
        self.mtimes: dict[str, int] = {}          # names whose mtime we set, and to what
        self.cur_kind = "setup"
        self.closed_inos: set[int] = set()       # reference inodes with a handle closed before
        self.trace: collections.deque = collections.deque(maxlen=400)   # checks done (history)

    # -- helpers ------------------------------------------------------------------------
    def _probe_ref_direct(self) -> bool:
        p = os.path.join(self.snapdir, "odirect-probe")
        try:
            fd = os.open(p, os.O_CREAT | os.O_RDWR | O_DIRECT, 0o644)
        except OSError:
            return False
        try:
            os.pwrite(fd, memoryview(self.buf)[:PAGE], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(p)

    def kp(self, n: str) -> str:
        return os.path.join(self.kd, n)

    def rp(self, n: str) -> str:
        return os.path.join(self.rd, n)

    def fail(self, what: str) -> None:
        msg = f"seed {self.cfg.seed} worker {self.k} op {self.op_no} [{self.cur_kind}]: {what}"
        if self.cfg.history:
            import re
            names = set(re.findall(r"\bf\d\d\b", what))
            for t in reversed(self.trace):      # and the names renamed onto them before
                if t.startswith("#") and " rename(" in t and names & set(re.findall(r"\bf\d\d\b", t)):
                    names |= set(re.findall(r"\bf\d\d\b", t))
            past = [t for t in self.trace if names & set(re.findall(r"\bf\d\d\b", t))]
            msg += "\n      history: " + " | ".join(past[-self.cfg.history:])
        self.mismatches.append(msg)
        self.counts["mismatch"] += 1
        self.counts["mismatch:" + self.cur_kind] += 1     # by the kind of the op that saw it
        if len(self.mismatches) > self.cfg.max_mismatches:
            raise Mismatch("too many mismatches; first: " + self.mismatches[0])

    def check(self, what: str, rk, rr) -> bool:
        """Compare two results; False (and a recorded mismatch) if they differ."""
        if self.cfg.history:
            self.trace.append(f"#{self.op_no} {what} -> {_ename(rr)}")
        if rk == rr:
            return True
        if rk[0] and rr[0] and isinstance(rk[1], bytes) and isinstance(rr[1], bytes):
            a, b = rk[1], rr[1]
            diff = [i for i in range(min(len(a), len(b))) if a[i] != b[i]]
            if diff:
                what += (f" [{len(diff)} bytes differ in {diff[0]}..{diff[-1]}"
                         f"{', kvfs has zeros there' if not any(a[diff[0]:diff[-1] + 1]) else ''}]")
        if not rk[0] and rk[1] == errno.ENOSPC:
            self.counts["enospc"] += 1
        self.fail(f"{what}: kvfs {_ename(rk)} reference {_ename(rr)}")
        return False

    def rino_of(self, n: str) -> int | None:
        try:
            return os.stat(self.rp(n)).st_ino
        except FileNotFoundError:
            return None

    def open_on(self, rino: int | None) -> list[Handle]:
        return [h for h in self.handles if h.rino == rino]

    def writers_on(self, rino: int | None) -> int:
        return sum(1 for h in self.handles if h.rino == rino and h.acc != os.O_RDONLY)

    def readers_bound_to_sealed(self, rino) -> list[Handle]:
        return [h for h in self.handles if h.rino == rino and h.acc == os.O_RDONLY and not h.frozen]

    def renewal(self, n: str, rino: int | None, kino: int | None, same: bool) -> int | None:
        """After a write open or truncate of ``n`` that kvfs let through: a file whose sealed
        version readers hold (passthrough or not, since stop 38; readers of an older version
        sharing its inode too) has its name given a new inode with the same version
        (docs/design.md, "Versions and sizes", "How a read travels"), so the name's kvfs
        inode changed. The reference does the same (the file copied and the copy renamed
        over the name): descriptors open on the old file keep it, and its size, as kvfs's
        readers keep theirs. With no descriptor of it open here (a reader's close whose
        RELEASE had not reached kvfs yet, or an eviction that an O_CREAT open then made a new
        file for) nothing is open on the old file: renewed when the content is the same
        either way (``same``), otherwise left to the eviction rule. Returns the name's
        reference inode."""
        if rino is None or kino is None or self.kino.get(n) in (None, kino):
            return rino
        if not self.open_on(rino):
            if same:
                self.kino[n] = kino
                self.counts["renewed_after_close"] += 1
            return rino
        rp, tmp = self.rp(n), self.rp(n) + "~renewed"
        shutil.copy2(rp, tmp)           # bytes, mode, times and xattrs, as kvfs's new inode has
        os.replace(tmp, rp)
        self.kino[n] = kino
        self.counts["renewed"] += 1
        if self.cfg.history:
            self.trace.append(f"#{self.op_no} [{self.cur_kind}] {n} renewed: kvfs inode {kino}")
        return os.stat(rp).st_ino

    def kino_now(self, n: str, fd: int | None = None) -> int | None:
        try:
            return os.fstat(fd).st_ino if fd is not None else os.stat(self.kp(n)).st_ino
        except OSError:
            return None

    def evicted(self, n: str) -> bool:
        """kvfs lost closed file ``n`` (ENOENT): drop it from the reference. False if its
        current version was open (then the ENOENT is a mismatch); readers frozen on an older
        version hold that version, not the name's current one, which kvfs may evict (their
        descriptors go on as after an unlink)."""
        rino = self.rino_of(n)
        if rino is None or any(not h.frozen for h in self.open_on(rino)):
            return False
        os.unlink(self.rp(n))
        self.kino.pop(n, None)
        self.counts["evicted"] += 1
        if self.cfg.history:
            self.trace.append(f"#{self.op_no} [{self.cur_kind}] kvfs ENOENT for closed {n}: taken as evicted")
        return True

    def content(self, fd: int) -> bytes:
        """All bytes of the reference file open on ``fd`` (whatever its access mode or
        O_DIRECT; unlinked too): read through a fresh descriptor of the same file."""
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            return f.read()

    def begin_session(self, rino: int) -> None:
        """A write session of ``rino`` starts (writable open, or truncate by path): readers of
        its sealed version keep that version; remember the sealed content for crash checks."""
        if self.writers_on(rino):
            return
        readers = self.readers_bound_to_sealed(rino)
        sealed = None
        for h in self.handles:
            if h.rino == rino and not h.frozen:
                sealed = self.content(h.rfd)
                break
        else:
            for n in self.names:
                if self.rino_of(n) == rino:
                    with open(self.rp(n), "rb") as f:
                        sealed = f.read()
                    break
        self.session_start[rino] = [sealed]
        for h in ([] if self.cfg.posix else readers):
            self.nsnap += 1
            snap = os.path.join(self.snapdir, f"s{self.nsnap}")
            with open(snap, "wb") as f:
                f.write(sealed or b"")
            fd = os.open(snap, os.O_RDONLY)
            h.live, h.rfd, h.frozen, h.snap = h.rfd, fd, True, snap
            self.counts["old_version_readers"] += 1

    def synced(self, h: Handle) -> None:
        """fsync (or msync, which fsyncs a shared mapping's file) by the only writer seals the
        current content, which a crash may then keep. The earlier versions stay acceptable: the
        daemon seals only if it has processed the FUSE_RELEASE of every other writer closed
        before, and the kernel sends those after close(2) returns."""
        if h.acc != os.O_RDONLY and self.writers_on(h.rino) == 1:
            self.session_start.setdefault(h.rino, [None]).append(self.content(h.rfd))

    def end_session_if_done(self, rino: int) -> None:
        if not self.writers_on(rino):
            self.session_start.pop(rino, None)

    def pick_handle(self, pred=lambda h: True) -> Handle | None:
        hs = [h for h in self.handles if pred(h)]
        return self.rng.choice(hs) if hs else None

    def data(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def in_place_old(self, h: Handle) -> bool:
        """``h`` reads an old version of a file rewritten in place (a reader frozen on its
        snapshot when a writer opened the same inode)."""
        return h.frozen

    def rsize(self, h: Handle) -> int:
        """The size the reference says ``h`` is told: its file's current size (for an older
        version's descriptor too: the kernel keeps one size per inode)."""
        return os.fstat(h.live if h.frozen else h.rfd).st_size

    def old_read(self, h: Handle, ln: int, off: int) -> bytes:
        """What an older version's descriptor reads (docs/design.md, "Versions and sizes"):
        its version's bytes, zeros past their end, EOF at the file's current size."""
        want = max(0, min(off + ln, self.rsize(h)) - off)
        got = os.pread(h.rfd, want, off) if want else b""
        self.counts["old_version_reads"] += 1
        if len(got) < want:
            self.counts["old_version_zeros"] += 1      # past its version's end: zeros
        return got + bytes(want - len(got))

    def cmp_fsize(self, h: Handle, what: str) -> None:
        rk, rr = _call(lambda: os.fstat(h.kfd).st_size), _call(self.rsize, h)
        self.check(f"{what}: fstat size of {h.name}", rk, rr)

    # -- the run ------------------------------------------------------------------------
    def run(self, n_ops: int) -> None:
        for _ in range(n_ops):
            self.op_no += 1
            self.step()

    def step(self) -> None:
        for _ in range(20):                       # a kind whose preconditions fail: pick again
            if self.variants and self.rng.random() < 0.08:
                kind = self.rng.choice(self.variants)
            else:
                kind = self.rng.choices(self.kinds, [WEIGHTS[k_] for k_ in self.kinds])[0]
            self.cur_kind = kind
            if getattr(self, "op_" + kind)() is not False:
                self.counts[kind] += 1
                self.counts["ops"] += 1
                return

    # each op returns False when it cannot run now (nothing was done)
    def _open(self, n: str, acc: int, creat: bool, trunc: bool, append: bool, direct: bool) -> bool:
        if len(self.handles) >= self.cfg.max_open:
            return False
        flags = acc | (os.O_CREAT if creat else 0) | (os.O_TRUNC if trunc else 0) | (os.O_APPEND if append else 0)
        rino = self.rino_of(n)
        writing = acc != os.O_RDONLY
        if rino is not None and acc != os.O_RDONLY and self.readers_bound_to_sealed(rino) \
                and not self.writers_on(rino) and "old_version_reader" in self.cfg.exclude:
            return False
        kflags = flags | (O_DIRECT if direct else 0)
        rflags = flags | (O_DIRECT if direct and self.ref_direct else 0)
        rk = _call(os.open, self.kp(n), kflags, 0o644)
        if rk[0] and (writing or trunc):
            same = trunc or _call(lambda: os.fstat(rk[1]).st_size == os.stat(self.rp(n)).st_size) == (True, True)
            rino = self.renewal(n, rino, self.kino_now(n, rk[1]), same)
        if rino is not None and writing:
            self.begin_session(rino)        # (reads only the reference: after kvfs's open is fine)
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            if not creat:
                return True
            if "creat_enoent_evicted" in self.cfg.exclude:
                # a race fixed in issue 11: the kernel still had the evicted name's
                # dentry, sent OPEN (not CREATE), and the daemon answered ENOENT
                self.counts["creat_enoent_evicted"] += 1
                return True
            self.fail(f"open({n}, {flags:#o}): kvfs ENOENT with O_CREAT (the file was evicted)")
            return True
        if rk[0]:
            kino = os.fstat(rk[1]).st_ino
            if n in self.kino and self.kino[n] != kino and rino is not None \
                    and not any(not h.frozen for h in self.open_on(rino)):
                # evicted and recreated by O_CREAT between two looks: the reference follows (as
                # in evicted(), readers frozen on an older version do not hold the current one)
                os.unlink(self.rp(n))
                self.counts["evicted"] += 1
                rino = None
                if self.cfg.history:
                    self.trace.append(f"#{self.op_no} open({n}) found inode {kino}, not {self.kino[n]}: taken as evicted and recreated")
            self.kino[n] = kino
        rr = _call(os.open, self.rp(n), rflags, 0o644)
        norm = (lambda r: (r[0], None if r[0] else r[1]))      # descriptors differ, not a mismatch
        if not self.check(f"open({n}, {flags:#o}{' O_DIRECT' if direct else ''})", norm(rk), norm(rr)):
            for ok, fd in (rk, rr):
                if ok:
                    os.close(fd)
            return True
        if not rk[0]:
            return True
        new_rino = os.fstat(rr[1]).st_ino
        h = Handle(n, rk[1], rr[1], acc, append, direct, new_rino)
        # kvfs opens a handle direct_io when another version of the inode is open. A handle
        # closed earlier may still count: the kernel sends FUSE_RELEASE after close(2) returns.
        h.maybe_direct_io = bool(self.open_on(new_rino)) or new_rino in self.closed_inos
        if rino is None and writing:
            self.session_start.setdefault(new_rino, [None])   # created in this session: no sealed version
        self.handles.append(h)                    # (a reader opened while writers are open shares their buffer)
        self.cmp_fsize(h, "after open")
        return True

    def op_open(self):
        n = self.rng.choice(self.names)
        acc = self.rng.choice([os.O_RDONLY, os.O_RDONLY, os.O_RDWR, os.O_RDWR, os.O_WRONLY])
        creat = acc != os.O_RDONLY and self.rng.random() < 0.6
        trunc = acc != os.O_RDONLY and self.rng.random() < 0.15
        append = acc != os.O_RDONLY and self.rng.random() < 0.2
        return self._open(n, acc, creat, trunc, append, False)

    def op_rdonly_creat(self):
        return self._open(self.rng.choice(self.names), os.O_RDONLY, True, False, False, False)

    def op_close(self, h: Handle | None = None):
        h = h or self.pick_handle()
        if h is None:
            return False
        self.handles.remove(h)
        self.closed_inos.add(h.rino)
        rk, rr = _call(os.close, h.kfd), _call(os.close, h.rfd)
        if h.snap:
            os.unlink(h.snap)
        if h.live is not None:
            os.close(h.live)
        self.check(f"close({h.name})", rk, rr)
        self.end_session_if_done(h.rino)
        return True

    def op_pread(self):
        h = self.pick_handle(lambda h: h.acc != os.O_WRONLY and not h.direct)
        if h is None:
            return False
        size = self.rsize(h)
        off = self.rng.randrange(0, size + 1) if size and self.rng.random() < 0.9 else self.rng.randrange(0, self.cfg.max_size)
        ln = self.rng.randrange(1, self.cfg.max_io)
        if self.in_place_old(h):
            self.check(f"pread old version ({h.name}, {ln}, {off})", _call(os.pread, h.kfd, ln, off),
                       (True, self.old_read(h, ln, off)))
            return True
        self.check(f"pread({h.name}, {ln}, {off})", _call(os.pread, h.kfd, ln, off), _call(os.pread, h.rfd, ln, off))
        return True

    def _write(self, h: Handle, data: bytes, off: int, what: str) -> None:
        if h.append:
            rk, rr = _call(os.write, h.kfd, data), _call(os.write, h.rfd, data)
        else:
            rk, rr = _call(os.pwrite, h.kfd, data, off), _call(os.pwrite, h.rfd, data, off)
        self.check(f"{what}({h.name}, {len(data)}, {'append' if h.append else off})", rk, rr)
        self.cmp_fsize(h, what)

    def op_pwrite(self):
        h = self.pick_handle(lambda h: h.acc != os.O_RDONLY and not h.direct)
        if h is None:
            return False
        self._write(h, self.data(self.rng.randrange(1, self.cfg.max_io)), self.rng.randrange(0, self.cfg.max_size), "pwrite")
        return True

    def op_bulk_write(self):
        h = self.pick_handle(lambda h: h.acc != os.O_RDONLY and not h.direct and not h.append)
        if h is None:
            return False
        self._write(h, self.data(self.rng.randrange(self.cfg.max_size // 2, self.cfg.max_size)), 0, "bulk_write")
        return True

    def op_append(self):
        h = self.pick_handle(lambda h: h.append and not h.direct)
        if h is None:
            return False
        self._write(h, self.data(self.rng.randrange(1, self.cfg.max_io)), 0, "append")
        return True

    def op_ftruncate(self):
        h = self.pick_handle(lambda h: h.acc != os.O_RDONLY)
        if h is None:
            return False
        size = self.rng.randrange(0, self.cfg.max_size)
        self.check(f"ftruncate({h.name}, {size})", _call(os.ftruncate, h.kfd, size), _call(os.ftruncate, h.rfd, size))
        self.cmp_fsize(h, "ftruncate")
        return True

    def op_truncate(self):
        n = self.rng.choice(self.names)
        rino = self.rino_of(n)
        if rino is not None and self.readers_bound_to_sealed(rino) and not self.writers_on(rino) \
                and "old_version_reader" in self.cfg.exclude:
            return False
        size = self.rng.randrange(0, self.cfg.max_size)
        rk = _call(os.truncate, self.kp(n), size)
        if rk[0]:
            rino = self.renewal(n, rino, self.kino_now(n), same=True)
        if rino is not None:
            self.begin_session(rino)        # (reads only the reference: after kvfs's truncate is fine)
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return True
        self.check(f"truncate({n}, {size})", rk, _call(os.truncate, self.rp(n), size))
        if rino is not None:
            self.end_session_if_done(rino)
        return True

    def op_rename(self):
        a, b = self.rng.sample(self.names, 2)
        if "unlink_while_open" in self.cfg.exclude and self.open_on(self.rino_of(b)) and self.rino_of(b) is not None:
            return False                          # replacing b would unlink an open file
        rk = _call(os.rename, self.kp(a), self.kp(b))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(a):
            return True
        rr = _call(os.rename, self.rp(a), self.rp(b))
        if self.check(f"rename({a}, {b})", rk, rr) and rk[0]:
            if a in self.kino:
                self.kino[b] = self.kino.pop(a)
            else:
                self.kino.pop(b, None)
            self.note_kino(b)
        return True

    def _unlink(self, n: str) -> None:
        rk = _call(os.unlink, self.kp(n))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return
        if self.check(f"unlink({n})", rk, _call(os.unlink, self.rp(n))) and rk[0]:
            self.kino.pop(n, None)

    def op_unlink(self):
        closed = [n for n in self.names if not self.open_on(self.rino_of(n))]
        if "unlink_while_open" in self.cfg.exclude:
            if not closed:
                return False
            self._unlink(self.rng.choice(closed))
        else:
            self._unlink(self.rng.choice(self.names))
        return True

    def op_unlink_while_open(self):
        opened = [n for n in self.names if self.rino_of(n) is not None and self.open_on(self.rino_of(n))]
        if not opened:
            return False
        self._unlink(self.rng.choice(opened))
        return True

    def note_kino(self, n: str) -> None:
        """Remember the kvfs inode of ``n``: an O_CREAT open that gets another one found the
        file evicted (and made a new one)."""
        try:
            self.kino[n] = os.stat(self.kp(n)).st_ino
        except FileNotFoundError:           # evicted right after the rename
            self.kino.pop(n, None)
            if not self.evicted(n):
                self.fail(f"stat({n}) after a rename onto it: kvfs ENOENT while its current version is open")
        except OSError:
            self.kino.pop(n, None)

    def op_stat(self):
        n = self.rng.choice(self.names)
        rk = _call(lambda: (stat.S_IFMT(os.stat(self.kp(n)).st_mode), os.stat(self.kp(n)).st_size))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return True
        rr = _call(lambda: (stat.S_IFMT(os.stat(self.rp(n)).st_mode), os.stat(self.rp(n)).st_size))
        self.check(f"stat({n})", rk, rr)
        return True

    def op_fstat(self):
        h = self.pick_handle()
        if h is None:
            return False
        self.cmp_fsize(h, "fstat")
        return True

    def _readdir(self) -> None:
        rk = _call(os.listdir, self.kd)
        rr = _call(os.listdir, self.rd)
        if not (rk[0] and rr[0]):
            self.check("listdir", rk, rr)
            return
        for n in set(rr[1]) - set(rk[1]):
            if not self.evicted(n):
                self.fail(f"listdir: {n} missing on kvfs (open there)")
        for n in set(rk[1]) - set(rr[1]):
            self.fail(f"listdir: {n} on kvfs only")
        for h in self.handles:                  # readdir must not change what open fds see
            self.cmp_fsize(h, "fstat after listdir")

    def op_readdir(self):
        if "readdir_while_writing" in self.cfg.exclude and any(h.acc != os.O_RDONLY for h in self.handles):
            return False
        self._readdir()
        return True

    def op_readdir_while_writing(self):
        if not any(h.acc != os.O_RDONLY for h in self.handles):
            return False
        self._readdir()
        return True

    def _map_len(self, h: Handle) -> int | None:
        """``fstat``'s size if both sides agree and it is > 0: the mapping is read up to its
        last byte (a SIGBUS inside that size kills the worker)."""
        ks, rs = os.fstat(h.kfd).st_size, self.rsize(h)
        if ks != rs:
            self.fail(f"mmap: fstat size of {h.name}: kvfs {ks} reference {rs}")
            return None
        return rs or None

    def _mmap(self, h: Handle, write: bool):
        size = self._map_len(h)
        if size is None:
            return True
        try:
            return self._mmap_io(h, size, write)
        finally:
            # Python's mmap.mmap dup()s the descriptor and closes the dup when the mapping is
            # closed (or at once if mmap(2) fails): that close(2) is a FUSE_FLUSH of the same
            # handle, and a flush by the only writer seals (docs/design.md, "Write path") — a
            # version a kill -9 may leave, even though the descriptor itself stays open
            if h.acc != os.O_RDONLY:
                self.synced(h)

    def _mmap_io(self, h: Handle, size: int, write: bool):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        rk = _call(mmap.mmap, h.kfd, size, mmap.MAP_SHARED, prot)
        if not rk[0] and rk[1] == errno.ENODEV and h.maybe_direct_io:
            self.counts["mmap_enodev"] += 1     # documented: direct_io handle (another version open)
            return True
        if h.frozen and rk[0]:                # an older version: against its snapshot (not mapped)
            return self._mmap_old(h, rk[1], size)
        rr = _call(mmap.mmap, h.rfd, size, mmap.MAP_SHARED, prot)
        if not self.check(f"mmap({h.name}, {size})", (rk[0], None if rk[0] else rk[1]), (rr[0], None if rr[0] else rr[1])):
            for ok, m in (rk, rr):
                if ok:
                    m.close()
            return True
        if not rk[0]:
            return True
        km, rm = rk[1], rr[1]
        try:
            off = self.rng.randrange(0, size)
            ln = min(size - off, self.rng.randrange(1, self.cfg.max_io))
            if write:
                d = self.data(ln)
                km[off:off + ln] = d
                rm[off:off + ln] = d
                if self.check(f"msync({h.name}) after writing [{off}:{off + ln}]", _call(km.flush), _call(rm.flush)):
                    self.synced(h)
            else:
                if km[off:off + ln] != rm[off:off + ln]:
                    self.fail(f"mmap read {h.name} [{off}:{off + ln}]: bytes differ")
                tail = max(0, size - self.rng.randrange(1, 2 * PAGE))     # up to fstat's size
                if km[tail:size] != rm[tail:size]:
                    self.fail(f"mmap read {h.name} [{tail}:{size}] (to fstat's size): bytes differ")
        finally:
            km.close()
            rm.close()
        self.cmp_fsize(h, "after mmap")
        return True

    def _mmap_old(self, h: Handle, km, size: int):
        """An older version's mapping of ``size`` bytes (fstat's): a random range and the tail
        up to the last byte, against its snapshot fitted to that size."""
        try:
            off = self.rng.randrange(0, size)
            ln = min(size - off, self.rng.randrange(1, self.cfg.max_io))
            tail = max(0, size - self.rng.randrange(1, 2 * PAGE))
            for a, b in ((off, off + ln), (tail, size)):
                if km[a:b] != self.old_read(h, b - a, a):
                    self.fail(f"mmap read old version {h.name} [{a}:{b}] of {size}: bytes differ")
        finally:
            km.close()
        self.cmp_fsize(h, "after mmap")
        return True

    def op_mmap_read(self):
        h = self.pick_handle(lambda h: h.acc != os.O_WRONLY and not h.direct)
        return False if h is None else self._mmap(h, False)

    def appending(self, rino: int) -> bool:
        """An O_APPEND descriptor is open on the inode: the kernel writes a shared mapping's
        dirty pages back through any writable handle of the inode, that one included."""
        return any(h.append for h in self.handles if h.rino == rino)

    def op_mmap_write(self):
        h = self.pick_handle(lambda h: h.acc == os.O_RDWR and not h.direct and not h.append)
        if h is None or ("mmap_write_append" in self.cfg.exclude and self.appending(h.rino)):
            return False
        return self._mmap(h, True)

    def op_mmap_write_append(self):
        h = self.pick_handle(lambda h: h.acc == os.O_RDWR and not h.direct and self.appending(h.rino))
        return False if h is None else self._mmap(h, True)

    def _fallocate(self, h: Handle) -> None:
        off, ln = self.rng.randrange(0, self.cfg.max_size), self.rng.randrange(1, self.cfg.max_io)
        what = f"posix_fallocate({h.name}, {off}, {ln})"
        if not self.cfg.posix and self._fallocate_ebadf(h, off, ln):
            # documented (docs/design.md): no FUSE_FALLOCATE, so glibc emulates posix_fallocate,
            # which refuses O_APPEND descriptors and reads (EBADF on O_WRONLY) before writing
            # over existing bytes; nothing is written, so the reference does nothing
            self.check(what, _call(os.posix_fallocate, h.kfd, off, ln), (False, errno.EBADF))
            self.counts["fallocate_ebadf"] += 1
        else:
            self.check(what, _call(os.posix_fallocate, h.kfd, off, ln), _call(os.posix_fallocate, h.rfd, off, ln))
        self.cmp_fsize(h, "fallocate")

    def _fallocate_ebadf(self, h: Handle, off: int, ln: int) -> bool:
        """glibc's emulation: EBADF for O_APPEND; for O_WRONLY when its first one-byte probe
        (at ``off + (ln - 1) % step``, step = the block size capped at 4096) is inside the file."""
        if h.append:
            return True
        if h.acc != os.O_WRONLY:
            return False
        bsize = os.fstatvfs(h.kfd).f_bsize
        step = 512 if bsize == 0 else min(bsize, 4096)
        return off + (ln - 1) % step < os.fstat(h.rfd).st_size

    def op_fallocate(self):
        h = self.pick_handle(lambda h: h.acc == os.O_RDWR and not h.append)
        if h is None:
            return False
        self._fallocate(h)
        return True

    def op_fallocate_wronly(self):
        h = self.pick_handle(lambda h: h.acc == os.O_WRONLY or (h.acc != os.O_RDONLY and h.append))
        if h is None:
            return False
        self._fallocate(h)
        return True

    def op_xattr(self):
        n = self.rng.choice(self.names)
        key = f"user.fsx.{self.rng.randrange(3)}"
        what = self.rng.choice(["set", "set", "get", "list", "remove"])

        def do(p):
            if what == "set":
                return os.setxattr(p, key, val)
            if what == "get":
                return os.getxattr(p, key)
            if what == "list":
                return sorted(a for a in os.listxattr(p) if not a.startswith("user.kvfs."))
            return os.removexattr(p, key)
        val = self.data(self.rng.randrange(1, 200))
        rk = _call(do, self.kp(n))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return True
        self.check(f"xattr {what} {key} of {n}", rk, _call(do, self.rp(n)))
        return True

    def _utime(self, n: str) -> None:
        t = self.rng.randrange(10 ** 9, 2 * 10 ** 9) * 10 ** 9
        rk = _call(os.utime, self.kp(n), ns=(t, t))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return
        if self.check(f"utime({n})", rk, _call(os.utime, self.rp(n), ns=(t, t))) and rk[0]:
            self.mtimes[n] = t

    def op_utime(self):
        closed = [n for n in self.names if self.rino_of(n) is not None and not self.writers_on(self.rino_of(n))]
        if not closed:
            return False
        self._utime(self.rng.choice(closed))
        self.check_mtimes()
        return True

    def op_utime_while_writing(self):
        names = [n for n in self.names if self.rino_of(n) is not None and self.writers_on(self.rino_of(n))]
        if not names:
            return False
        self._utime(self.rng.choice(names))
        return True

    def check_mtimes(self) -> None:
        """Files whose mtime we set and nobody wrote since keep it (also across a seal)."""
        for n in list(self.mtimes):
            try:
                r = os.stat(self.rp(n)).st_mtime_ns
            except FileNotFoundError:
                self.mtimes.pop(n)
                continue
            if r != self.mtimes[n]:              # written since: the mtime moved legitimately
                self.mtimes.pop(n)
                continue
            if self.writers_on(self.rino_of(n)):
                continue
            rk = _call(lambda: os.stat(self.kp(n)).st_mtime_ns)
            if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
                self.mtimes.pop(n)
                continue
            self.check(f"mtime of {n}", rk, (True, r))

    def op_fsync(self):
        h = self.pick_handle(lambda h: h.acc != os.O_RDONLY)
        if h is None:
            return False
        if self.check(f"fsync({h.name})", _call(os.fsync, h.kfd), _call(os.fsync, h.rfd)):
            self.synced(h)
        return True

    def op_odirect(self):
        h = self.pick_handle(lambda h: h.direct)
        if h is None:
            n = self.rng.choice(self.names)
            acc = self.rng.choice([os.O_RDONLY, os.O_RDWR])
            return self._open(n, acc, acc == os.O_RDWR, False, False, True)
        ln = self.rng.randrange(1, self.cfg.max_io // PAGE + 1) * PAGE
        off = self.rng.randrange(0, self.cfg.max_size // PAGE) * PAGE
        mv = memoryview(self.buf)[:ln]
        if h.acc == os.O_RDONLY or self.rng.random() < 0.5:
            rk = _call(os.preadv, h.kfd, [mv], off)
            got = bytes(mv[:rk[1]]) if rk[0] else None
            rr = _call(os.preadv, h.rfd, [mv], off)
            want = bytes(mv[:rr[1]]) if rr[0] else None
            if self.in_place_old(h):             # its version's bytes fitted to the current size
                self.check(f"O_DIRECT pread old version ({h.name}, {ln}, {off})",
                           (rk[0], got if rk[0] else rk[1]), (True, self.old_read(h, ln, off)))
            elif self.check(f"O_DIRECT pread({h.name}, {ln}, {off})", (rk[0], None if rk[0] else rk[1]),
                          (rr[0], None if rr[0] else rr[1])) and rk[0] and got != want:
                self.fail(f"O_DIRECT pread({h.name}, {ln}, {off}): {len(got)} vs {len(want)} bytes, differ")
        else:
            mv[:] = self.data(ln)
            self.check(f"O_DIRECT pwrite({h.name}, {ln}, {off})", _call(os.pwritev, h.kfd, [mv], off),
                       _call(os.pwritev, h.rfd, [mv], off))
        self.cmp_fsize(h, "O_DIRECT")
        return True

    def op_old_version_reader(self):
        """Open a reader, then start a new version of the file under it (write + close)."""
        n = self.rng.choice(self.names)
        rino = self.rino_of(n)
        if rino is None or self.writers_on(rino) or len(self.handles) + 2 > self.cfg.max_open:
            return False
        before = len(self.handles)
        self._open(n, os.O_RDONLY, False, False, False, False)
        if len(self.handles) == before:
            return True
        h = self.handles[-1]
        self._open(n, os.O_RDWR, False, self.rng.random() < 0.3, False, False)
        if len(self.handles) == before + 2:
            w = self.handles[-1]
            self._write(w, self.data(self.rng.randrange(1, self.cfg.max_io)), self.rng.randrange(0, self.cfg.max_size), "pwrite")
            self.op_close(w)
        # documented (docs/design.md, "Versions and sizes"): the kernel keeps one size per
        # inode, so a reader of the old version of a file rewritten in place is told the new
        # version's size; it reads the old version's bytes, then zeros, up to that size
        size = self.rsize(h)
        want = self.old_read(h, size + 100, 0) if h.frozen else os.pread(h.rfd, size + 100, 0)
        self.check(f"pread old version of {n}", _call(os.pread, h.kfd, size + 100, 0), (True, want))
        self.cmp_fsize(h, "old version reader")
        return True

    def op_read_file(self):
        n = self.rng.choice(self.names)

        def rd(p):
            with open(p, "rb") as f:
                return f.read()
        rk = _call(rd, self.kp(n))
        if not rk[0] and rk[1] == errno.ENOENT and self.evicted(n):
            return True
        self.check(f"read whole {n}", rk, _call(rd, self.rp(n)))
        return True

    # -- phases ---------------------------------------------------------------------------
    def expected_after_crash(self) -> dict[str, list]:
        """Per name: the sha256s of the contents kvfs may show after a kill -9 (its last sealed
        version; an empty list: it may only be absent). A file with writers open maps to its
        sealed content when the session began and to what each fsync since sealed."""
        out = {}
        for n in self.names:
            rino = self.rino_of(n)
            if rino is None:
                continue
            if self.writers_on(rino):
                out[n] = [hashlib.sha256(v).hexdigest() for v in self.session_start.get(rino, [None]) if v is not None]
            else:
                with open(self.rp(n), "rb") as f:
                    out[n] = [hashlib.sha256(f.read()).hexdigest()]
        return out

    def verify_after_crash(self, expected: dict) -> None:
        """After kill -9 and remount: every file is its last sealed version or absent; then
        the reference takes what kvfs kept and every descriptor is dropped."""
        self.cur_kind = "crash"
        for h in self.handles:
            for fd in (h.kfd, h.rfd) + ((h.live,) if h.live is not None else ()):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if h.snap:
                os.unlink(h.snap)
        self.handles.clear()
        self.session_start.clear()
        self.mtimes.clear()
        self.kino.clear()
        try:
            knames = set(os.listdir(self.kd))
        except FileNotFoundError:
            os.makedirs(self.kd, exist_ok=True)
            knames = set()
        for n in sorted(knames | set(expected) | set(os.listdir(self.rd))):
            try:
                with open(self.kp(n), "rb") as f:
                    got = f.read()
            except FileNotFoundError:
                got = None
            if got is None:
                self.counts["crash_absent"] += 1
                if os.path.exists(self.rp(n)):
                    os.unlink(self.rp(n))
                continue
            try:
                self.kino[n] = os.stat(self.kp(n)).st_ino
            except OSError:
                pass
            if hashlib.sha256(got).hexdigest() not in expected.get(n, []):
                self.counts["crash_mismatch"] += 1
                self.fail(f"after kill -9: {n} holds {len(got)} bytes that are not its last sealed version")
            else:
                self.counts["crash_intact"] += 1
            with open(self.rp(n), "wb") as f:
                f.write(got)

    def close_all(self) -> None:
        for h in list(self.handles):
            self.op_close(h)

    def report(self) -> dict:
        return {"worker": self.k, "counts": dict(self.counts), "mismatches": self.mismatches[:50]}


def _worker_main(cfg: Config, k: int, conn) -> None:
    """A worker process: commands from the parent over ``conn``."""
    w = Worker(cfg, k)
    while True:
        cmd, arg = conn.recv()
        t0 = time.perf_counter()
        try:
            if cmd == "run":
                w.run(arg)
                conn.send(("ok", {"seconds": time.perf_counter() - t0, **w.report()}))
            elif cmd == "pause":
                conn.send(("ok", {"expected": w.expected_after_crash(), "open": len(w.handles)}))
            elif cmd == "verify":
                w.verify_after_crash(arg)
                conn.send(("ok", w.report()))
            elif cmd == "finish":
                w.cur_kind = "finish"
                w.close_all()
                w.check_mtimes()
                w._readdir()
                conn.send(("ok", w.report()))
                return
        except Mismatch as e:
            conn.send(("mismatch", {"error": str(e), **w.report()}))
            return
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            import traceback
            conn.send(("error", {"error": traceback.format_exc(), **w.report()}))
            return


class Exerciser:
    """The parent: N worker processes, phases of operations, crash checks between phases."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        ctx = mp.get_context("spawn")          # no fork with threads or an LMDB env around
        self.conns, self.procs = [], []
        for k in range(cfg.procs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(cfg, k, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.reports: list[dict] = []

    def _all(self, cmd: str, args=None) -> list:
        args = args if args is not None else [None] * len(self.conns)
        for c, a in zip(self.conns, args):
            c.send((cmd, a))
        out = []
        for c, p in zip(self.conns, self.procs):
            try:
                status, val = c.recv()
            except EOFError:                  # the worker died (SIGBUS: an mmap read past the end)
                p.join(30)
                raise AssertionError(f"fsx worker {self.procs.index(p)} died: exit code {p.exitcode}"
                                     f"{' (SIGBUS)' if p.exitcode == -7 else ''}") from None
            if status != "ok":
                raise AssertionError(f"fsx worker {status}: {val.get('error')}\n{json.dumps(val.get('counts'))}"
                                     f"\n" + "\n".join(val.get("mismatches", [])[:20]))
            out.append(val)
        return out

    def run(self, n_ops: int) -> list[dict]:
        per = max(1, n_ops // len(self.conns))
        t0 = time.perf_counter()
        reps = self._all("run", [per] * len(self.conns))
        for r in reps:
            r["wall"] = time.perf_counter() - t0
        self.reports.append({"phase": "run", "reports": reps})
        return reps

    def pause(self) -> list:
        """Every worker stops between two operations; returns what each expects after a crash.
        ``open_handles``: the kvfs descriptors they hold open. (Before killing the daemon, wait
        until its ``.kvfs/stats`` ``open_handles`` equals that: the kernel sends FUSE_RELEASE
        after close(2) returns, and a file whose last writer was closed is sealed only when the
        daemon has processed the releases of its other writers.)"""
        reps = self._all("pause")
        self.open_handles = sum(r["open"] for r in reps)
        return [r["expected"] for r in reps]

    def verify(self, expected: list) -> list[dict]:
        reps = self._all("verify", expected)
        self.reports.append({"phase": "verify", "reports": reps})
        return reps

    def finish(self) -> list[dict]:
        reps = self._all("finish")
        self.reports.append({"phase": "finish", "reports": reps})
        self.close()
        return reps

    def close(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def summarize(reports: list[dict]) -> dict:
    """Totals over the last report of each worker (counts are cumulative per worker)."""
    last: dict[int, dict] = {}
    for ph in reports:
        for r in ph["reports"]:
            last[r["worker"]] = r
    total = collections.Counter()
    mism: list[str] = []
    for r in last.values():
        total.update(r["counts"])
        mism += r["mismatches"]
    return {"counts": dict(total), "mismatches": mism}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kvfs_dir")
    ap.add_argument("ref_dir")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--exclude-known-broken", action="store_true")
    ap.add_argument("--history", type=int, default=0, help="earlier checks of the file shown per mismatch")
    ap.add_argument("--max-mismatches", type=int, default=200)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--tiers", action="store_true", help="print the seed's tier sizes (--ram, --nvme-size) and exit")
    a = ap.parse_args(argv)
    if a.tiers:
        t = tier_sizes(a.seed)
        print(f"--ram {t['ram']} --nvme-size {t['nvme_size']}")
        return 0
    cfg = Config(a.kvfs_dir, a.ref_dir, seed=a.seed, ops=a.ops, procs=a.procs,
                 exclude=tuple(sorted(KNOWN_BROKEN)) if a.exclude_known_broken else (),
                 history=a.history, max_mismatches=a.max_mismatches)
    ex = Exerciser(cfg)
    t0 = time.perf_counter()
    try:
        ex.run(a.ops)
        ex.finish()
    finally:
        ex.close()
    s = summarize(ex.reports)
    s["seconds"] = time.perf_counter() - t0
    print(json.dumps(s["counts"], sort_keys=True))
    for m in s["mismatches"]:
        print(m)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 1 if s["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
