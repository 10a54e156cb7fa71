"""A directory of raw KV page files on a kvfs mount, as runtime storage backends use it.

A page is one file ``<dir>/<name>`` holding the page's bytes and nothing else (what the
runtimes' own file backends write). :class:`PageStore` gives an adapter the three operations
runtimes need, each batched the way kvfs makes cheap:

* ``prefix(names)``: how many leading pages exist -- one ``.kvfs/lookup`` round trip for the
  whole batch (a plain directory would need one ``stat`` per page).
* ``read_into(names, dests)``: one ``.kvfs/lease`` round trip for the batch; each leased page
  is read from its backing file (RAM tier's tmpfs file or the NVMe tier's file) beside FUSE,
  straight into the caller's buffers (``dests[i]``: the page's destination byte ranges in
  file order), and its whole-object xxh3_64 checked before the page counts as a hit; a page
  without a fast path (``null`` entry) is read through the mount (a *lease fallback*).
* ``write_many(names, bufs_of)``: the pages not yet present in one ``.kvfs/commit`` request
  (kvfs.kv.commit: via a memfd; the daemon copies, checksums and publishes each page as
  close+rename would); without a commit file, or for a page it refused: temp file, one
  ``writev``, ``rename`` through the mount. Names may contain subdirectories.

Failure policy (the runtime's worker thread must never see a kvfs exception): every error --
a dead or unmounted daemon (ENOTCONN), a vanished file, a short read, a checksum mismatch, a
malformed answer -- makes the affected pages misses, is counted and logged, and drops the
control-file descriptors so the next call reconnects. If the root stops being on a kvfs mount
(unmounted), nothing is read or written there (``require_kvfs``): the runtime recomputes.
Pure Python (no torch); thread-safe: each thread gets its own lease descriptor.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time

from kvfs.kv.block import ChecksumMismatch
from kvfs.kv.getbatch import EBADMSG, GetClient
from kvfs.kv.blockio import Backing, LeaseClient, VerifiedObjects, preadv_full
from kvfs.integrations.leased import Ahead, ahead_of, read_leased
from kvfs.integrations.pagewrite import PageWrites
from kvfs.kv import mapcheck
from kvfs.kv.lookup import PrefixLookup, find_control, makedirs_under
from kvfs.kv.names import REVALIDATE, NameView
from kvfs.integrations.pagetypes import (PIECE, Counters, LeaseHold, NotOnKvfs, PageSizeError,  # noqa: F401
                                         PageStoreStats, Stalled)

log = logging.getLogger(__name__)

_LOG_EVERY = 30.0          # seconds between repeated warnings of one kind


class PageStore(PageWrites):
    """Raw page files in ``<root>/<subdir>`` (``root`` inside a kvfs mount)."""

    def __init__(self, root: str | os.PathLike, subdir: str = "", *, require_kvfs: bool = True,
                 lease_ttl: float | None = None, verify_shm: str = "once", stall_timeout: float | None = 10.0,
                 use_commit: bool = True, revalidate: float | None = REVALIDATE):
        if verify_shm not in ("once", "always"):
            raise ValueError(f"verify_shm must be 'once' or 'always', got {verify_shm!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.dir = os.path.join(self.root, subdir) if subdir else self.root
        self.require_kvfs = require_kvfs
        self.lease_ttl = lease_ttl
        self.stall_timeout = stall_timeout
        self.use_commit = use_commit      # batched writes through .kvfs/commit (kvfs.kv.commit)
        self.revalidate = revalidate      # seconds between stats of the directory on table misses
        self._inflight: dict[object, float] = {}     # calls under way -> when they started
        self.verified = VerifiedObjects() if verify_shm == "once" else None
        self._lock = threading.Lock()
        self._local = threading.local()
        self._leases: list[LeaseClient] = []
        self._spares: list[LeaseClient] = []   # lease descriptors free for the next hold
        self._lookup: PrefixLookup | None = None
        self._names: NameView | None = None     # the mount's name table (misses without FUSE)
        self._mount_root: str | None = None
        self._dev = -1
        self._epoch = 0                   # bumped on every reset: threads reopen their leases
        self._counts = Counters()
        self._last_log: dict[str, float] = {}

    # -- connection -----------------------------------------------------------------------
    def _connect(self) -> PrefixLookup:
        """The lookup client, (re)opened on first use and after a reset."""
        lk = self._lookup
        if lk is not None:
            try:                            # still the filesystem we connected to? (a lazy
                same = os.stat(self.dir).st_dev == self._dev   # unmount keeps our fds working)
            except OSError:
                same = False
            if same:
                return lk
            log.warning("%s left its kvfs mount (unmounted?): closing the control files", self.dir)
            self.reset()
        with self._lock:
            if self._lookup is not None:
                return self._lookup
            probe = self.root              # the nearest existing ancestor says which filesystem
            while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
                probe = os.path.dirname(probe)
            ctl = find_control(probe)
            if ctl is None and self.require_kvfs:
                raise NotOnKvfs(errno.ENOTCONN, f"{self.root} is not inside a kvfs mount")
            dev = makedirs_under(ctl[0] if ctl is not None else None, self.dir)
            lk = PrefixLookup(self.dir, use_control=ctl is not None)
            try:                # the mount may have gone since find_control (unmounted meanwhile):
                on = lk.one_call and os.fstat(lk.fileno()).st_dev == dev == os.stat(self.dir).st_dev
            except OSError:
                on = False
            if ctl is not None and not on:
                lk.close()
                raise NotOnKvfs(errno.ENOTCONN, f"{self.root} left its kvfs mount while connecting")
            self._dev, self._mount_root = dev, lk.mount_root
            self._names = NameView(lk.mount_root, dev, self._dir_stat, self.revalidate) if lk.one_call else None
            self._lookup = lk
            log.debug("page store %s (%s)", self.dir, "kvfs" if lk.one_call else "plain directory")
            return lk

    def makedirs(self, path: str) -> None:
        """Make ``path`` through the kvfs mount's root (a mount gone meanwhile fails), else os.makedirs."""
        makedirs_under(self._connect().mount_root, path)

    @property
    def on_kvfs(self) -> bool:
        try:
            return self._connect().one_call
        except OSError:
            return False

    def _lease(self) -> LeaseClient | None:
        lk = self._connect()
        if not lk.one_call:
            return None
        st = self._local
        if getattr(st, "epoch", -1) != self._epoch or st.client is None:
            client = LeaseClient.open(self._mount_root, self.dir, ttl=self.lease_ttl)
            st.client, st.epoch = client, self._epoch
            if client is not None:
                with self._lock:
                    self._leases.append(client)
        return st.client

    def reset(self) -> None:
        """Drop the control-file descriptors (after an error); the next call reconnects."""
        with self._lock:
            lk, self._lookup = self._lookup, None
            names, self._names = self._names, None
            leases, self._leases = self._leases + self._spares, []
            self._spares = []
            self._epoch += 1
        self._count(reconnects=1)
        for c in [c for c in (lk, names) if c is not None] + leases:
            with contextlib.suppress(OSError):
                c.close()
        if self.verified is not None:
            self.verified.clear()

    @contextlib.contextmanager
    def _call(self):
        """One call that may wait on the daemon. A daemon that neither answers nor dies blocks the
        thread in its request like any FUSE filesystem; while a request of this store has waited
        longer than ``stall_timeout``, further calls fail at once (``Stalled``: a miss) instead
        of piling the runtime's threads up behind it. A call of many pages calls the yielded
        ``progress()`` after each page: what counts is the wait since the last answer."""
        waited = self._stalled()
        if waited:
            raise Stalled(errno.ETIMEDOUT, f"a kvfs request has been waiting {waited:.1f}s")
        token = object()
        self._inflight[token] = time.monotonic()

        def progress() -> None:
            self._inflight[token] = time.monotonic()
        try:
            yield progress
        finally:
            self._inflight.pop(token, None)

    def _stalled(self) -> float:
        """How long the oldest call under way has waited, if longer than ``stall_timeout``; else 0."""
        if self.stall_timeout is None or not self._inflight:
            return 0.0
        waited = time.monotonic() - min(list(self._inflight.values()), default=time.monotonic())
        return waited if waited > self.stall_timeout else 0.0

    def _failed(self, what: str, e: BaseException, pages: int) -> None:
        self._count(**{"stalled" if isinstance(e, Stalled) else "errors": 1})
        now = time.monotonic()
        if now - self._last_log.get(what, -1e9) >= _LOG_EVERY:
            self._last_log[what] = now
            log.warning("kvfs %s of %d page(s) in %s failed (%s: %s): treated as a miss",
                        what, pages, self.dir, type(e).__name__, e)
        else:
            log.debug("kvfs %s failed: %r", what, e)
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PageSizeError, Stalled)):
            self.reset()        # the daemon may be gone: reconnect on the next call

    def _count(self, **kw) -> None:
        self._counts.add(**kw)

    def statistics(self) -> PageStoreStats:
        return self._counts.snapshot()

    # -- existence ------------------------------------------------------------------------
    def prefix(self, names: list[str], table_hits: bool = True) -> int:
        """How many leading ``names`` exist as page files (0 on any failure). ``table_hits``
        False: pages the name table lists are still confirmed by one lookup request (its wait
        holds no GIL; probing many names holds it, against a scheduler thread that needs it)."""
        if not names:
            return 0
        probed = self._names
        if table_hits:                          # no round trip, no lock
            k = self._table_prefix(names)
        else:
            k = 0 if self._table_absent(names[0]) else None
        if k == 0:                              # a new prompt's first page: the common miss
            c = self._counts.mine()             # (no keyword dict: this path is ~4 us in all)
            c["lookups"] += 1
            c["lookup_misses"] += len(names)
            c["table_misses"] += 1
            return 0
        if k is not None:
            self._counts.add(lookups=1, lookup_hits=k, lookup_misses=len(names) - k, table_hits=k,
                             table_misses=int(k < len(names)))
            return k
        try:
            with self._call():
                k = self._prefix(names, probed)
        except Exception as e:         # noqa: BLE001 -- any failure is a miss
            self._failed("lookup", e, len(names))
            k = 0
        self._count(lookups=1, lookup_hits=k, lookup_misses=len(names) - k)
        return k

    def _prefix(self, names: list[str], probed) -> int:
        lk = self._connect()
        if lk.one_call:
            # the first page decides a miss (a new prompt): the lookup file costs two round trips
            if not self._first_exists(names[0], probed):
                return 0
            if len(names) == 1:
                return 1
        return lk.prefix_rel(names)

    def _table_prefix(self, names: list[str]) -> int | None:
        """How many leading ``names`` the name table lists (it answers as a lookup would, but
        from shared memory: a page it lists that is removed meanwhile is a miss of the read
        that follows, as after any lookup); None: it cannot tell for one of them (no table,
        a daemon that stopped answering, an inode due for its ``stat``): ask the daemon."""
        view = self._names
        if view is None or (self._inflight and self._stalled()):
            return None
        for i, name in enumerate(names):
            st = view.state_in(self.dir, name)
            if st is not True:
                return None if st is None else i
        try:        # "present" only while the directory is on this mount (not lazily unmounted)
            if self._dir_stat(self.dir).st_dev != self._dev:
                return None
        except OSError:
            return None
        return len(names)

    def _table_absent(self, name: str) -> bool:
        """The name table says page ``name`` is absent. No system call in the steady state: the
        directory's inode is cached while the table vouches for it (kvfs.kv.names), and stat-ed
        (``_dir_stat``) at most every ``revalidate`` seconds or after a directory went."""
        names = self._names
        if names is None or (self._inflight and self._stalled()):
            return False                # the guarded path answers (Stalled: a stopped daemon)
        return names.absent_in(self.dir, name)

    def absent_now(self, name: str) -> bool:
        """True: the name table says page ``name`` is absent, answered with no system call
        and nothing that may wait on the daemon (for a caller that must not block, such as
        vLLM's scheduler thread). False: not known without asking (present, or the table's
        directory inodes are due for their ``stat``): ask :meth:`prefix`."""
        names = self._names
        if names is None or (self._inflight and self._stalled()):
            return False
        if names.absent_in(self.dir, name, nonblocking=True):
            self._counts.add(lookups=1, lookup_misses=1, table_misses=1)
            return True
        return False

    def _dir_stat(self, path: str) -> os.stat_result:
        """The name table's stat of a directory: it may wait on the daemon, so it counts as a call
        under way (the stall guard), and it is counted (``table_stats``)."""
        inflight, token = self._inflight, object()
        inflight[token] = time.monotonic()
        try:
            self._counts.add(table_stats=1)
            return os.stat(path)
        finally:
            inflight.pop(token, None)

    def _first_exists(self, name: str, probed=None) -> bool:
        """Is the first page there? No round trip if the name table says it is absent (unless the
        caller ``probed`` this table), else one LOOKUP, or none if the kernel has the entry."""
        if (probed is None or probed is not self._names) and self._table_absent(name):
            self._count(table_misses=1)
            return False
        try:
            st = os.stat(os.path.join(self.dir, name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISREG(st.st_mode)

    # -- lookup-and-pin (LMCache's lookup_and_lock) ----------------------------------------
    def hold(self, names: list[str]) -> tuple[int, LeaseHold | None]:
        """How many leading ``names`` exist, found and pinned by one ``.kvfs/lease`` request on
        a descriptor of this hold's own: the pages stay where they are until
        :meth:`release_hold`. ``(0, None)`` on any failure."""
        if not names:
            return 0, None
        k, held = 0, None
        try:
            with self._call():
                lk = self._connect()
                if not lk.one_call:             # plain directory: a stat per page, nothing to pin
                    k = lk.prefix_rel(names)
                    held = LeaseHold(None, dict.fromkeys(names[:k]), self._epoch)
                elif not self._first_exists(names[0]):
                    pass                        # a miss (a new prompt): no lease round trip
                else:
                    client = self._spare()
                    try:
                        blocks = client.acquire(names)
                    except BaseException:
                        client.close()
                        raise
                    k = len(blocks)
                    held = LeaseHold(client, dict(zip(names, blocks)), self._epoch)
        except Exception as e:         # noqa: BLE001 -- any failure is a miss
            self._failed("lookup", e, len(names))
        self._count(lookups=1, lookup_hits=k, lookup_misses=len(names) - k)
        return k, held

    def _spare(self) -> LeaseClient:
        """A lease descriptor nobody holds a lease on (reused after release_hold)."""
        with self._lock:
            if self._spares:
                return self._spares.pop()
        client = LeaseClient.open(self._mount_root, self.dir, ttl=self.lease_ttl)
        if client is None:
            raise OSError(errno.ENOTSUP, f"no .kvfs/lease under {self._mount_root}")
        return client

    def release_hold(self, held: LeaseHold | None) -> None:
        """Give a hold's lease back (never raises: a lease the daemon cannot be told about
        ends with its descriptor, or its ttl)."""
        if held is None or held.client is None:
            return
        client, held.client = held.client, None
        try:
            if any(True for _ in held.backings):   # an empty lease pins nothing: the next request
                client.release()                   # on the descriptor ends it (no round trip now)
            with self._lock:
                if held.epoch == self._epoch and len(self._spares) < 64:
                    self._spares.append(client)
                    return
        except OSError as e:
            log.debug("lease release failed (%s): closing its descriptor", e)
        try:
            client.close()
        except OSError:
            pass

    def read_held(self, held: LeaseHold | None, names: list[str], dests: list[list[memoryview]]) -> list[bool]:
        """Read pages found by :meth:`hold` (their pinned backing files, beside FUSE; a page
        without a fast path, or not in the hold, through the mount). One flag per page, each
        page on its own (a failed page does not end the batch)."""
        n = len(names)
        ok = [False] * n
        fallbacks = checksum_errors = 0
        on_kvfs = held is not None and held.client is not None
        backings = held.backings if held is not None else {}
        try:
            with self._call() as progress, mapcheck.batch():     # one reading of the maps per call
                sizes = [sum(len(s) for s in d) for d in dests]
                batched = self._batch_get(names, dests, [i for i, name in enumerate(names) if on_kvfs and (
                    backings.get(name) is None or backings[name].size != sizes[i])])
                ahead, backs = Ahead(), [backings.get(x) for x in names]
                try:
                    for i, name in enumerate(names):
                        progress()
                        size = sizes[i]
                        b = backings.get(name)
                        if i in batched:
                            ok[i] = True
                            continue
                        nxt = ahead_of(i + 1, backs, dests, sizes, batched)
                        try:
                            r = self._read_leased(b, name, dests[i], size, ahead=ahead, i=i, nxt=nxt) \
                                if b is not None and b.size == size else None
                            if r is None:
                                r = self._read_mount(name, dests[i], size)
                                fallbacks += on_kvfs and r is not None
                            ok[i] = r is not None
                        except ChecksumMismatch as e:
                            checksum_errors += 1
                            self._failed("read", e, 1)
                        except (FileNotFoundError, PageSizeError) as e:
                            self._failed("read", e, 1)
                finally:
                    ahead.close()           # no read still writing into a runtime's buffer
        except Exception as e:         # noqa: BLE001 -- any failure is a miss
            self._failed("read", e, n)
        got = sum(ok)
        nbytes = sum(sum(len(s) for s in dests[i]) for i in range(n) if ok[i])
        self._count(gets=n, hits=got, misses=n - got, bytes_read=nbytes, lease_fallbacks=fallbacks,
                    checksum_errors=checksum_errors)
        return ok

    # -- reads ----------------------------------------------------------------------------
    def read_into(self, names: list[str], dests: list[list[memoryview]]) -> list[bool]:
        """Read each page ``names[i]`` into ``dests[i]`` (its destination byte ranges, in file
        order, writable). Returns one flag per page: True = read and verified. Pages after the
        first miss are not read (the runtimes use the leading run only)."""
        n = len(names)
        ok = [False] * n
        if not n:
            return ok
        fallbacks = [0]
        try:
            with self._call() as progress, mapcheck.batch():
                self._read_batch(names, dests, ok, fallbacks, progress)
        except ChecksumMismatch as e:
            self._count(checksum_errors=1)
            self._failed("read", e, n)
        except Exception as e:         # noqa: BLE001 -- any failure is a miss
            self._failed("read", e, n)
        got = sum(ok)
        nbytes = sum(sum(len(s) for s in dests[i]) for i in range(n) if ok[i])
        self._count(gets=n, hits=got, misses=n - got, bytes_read=nbytes, lease_fallbacks=fallbacks[0])
        return ok

    def _read_batch(self, names: list[str], dests: list[list[memoryview]], ok: list[bool],
                    fallbacks: list[int], progress) -> None:
        """One lease for the batch, then each page beside FUSE (or through the mount); an
        O_DIRECT page is read while the one before it is hashed (kvfs.integrations.leased)."""
        lease = self._lease()
        leased = lease.acquire(names) if lease is not None else None
        on_kvfs = self._lookup is not None and self._lookup.one_call
        sizes = [sum(len(s) for s in d) for d in dests]
        ahead = Ahead()
        try:
            batched = self._batch_get(names, dests, [i for i, b in enumerate(leased or ()) if b is None or
                                                     b.size != sizes[i]])
            for i, name in enumerate(names):
                if leased is not None and i >= len(leased):
                    return                  # not sealed when leased: a miss, and the run ends
                b = leased[i] if leased is not None else None
                size = sizes[i]
                if i in batched:
                    ok[i] = True
                    progress()
                    continue
                nxt = ahead_of(i + 1, leased or (), dests, sizes, batched)
                r = self._read_leased(b, name, dests[i], size, ahead=ahead, i=i, nxt=nxt) \
                    if b is not None and b.size == size else None
                if r is None:               # no fast path for it: through the mount
                    r = self._read_mount(name, dests[i], size)
                    if r is None:
                        return
                    fallbacks[0] += on_kvfs
                ok[i] = True
                progress()
        finally:
            ahead.close()                   # no read still writing into a runtime's buffer
            if leased is not None:
                lease.release(lease.generation)

    def _batch_get(self, names: list[str], dests: list[list[memoryview]], idx: list[int]) -> set[int]:
        """Read pages ``idx`` (no fast path) by one ``.kvfs/get``; the indices read and verified
        (the others go through the mount). A gone daemon raises; any other failure: none."""
        st = self._local
        if not idx:
            return set()
        if getattr(st, "get_epoch", -1) != self._epoch:
            st.getter, st.get_epoch = GetClient.open(self._mount_root, self.dir), self._epoch
            if st.getter is not None:
                with self._lock:
                    self._leases.append(st.getter)      # closed with the lease descriptors
        if st.getter is None:
            return set()
        try:
            res = st.getter.get_into([names[i] for i in idx], [dests[i] for i in idx])
        except OSError as e:
            if e.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV):
                raise
            log.debug("kvfs get of %d pages failed (%s): through the mount", len(idx), e)
            return set()
        done = {i for i, r in zip(idx, res) if r == 0}
        self._count(batch_reads=len(done), checksum_errors=sum(r == EBADMSG for r in res))
        return done

    def _read_leased(self, b: Backing, name: str, segs: list[memoryview], size: int, **ahead) -> int | None:
        """Read a leased page beside FUSE and verify it; None: use the mount (kvfs.integrations.leased)."""
        return read_leased(b, name, segs, size, local=self._local, verified=self.verified, **ahead)

    def _read_mount(self, name: str, segs: list[memoryview], size: int) -> int | None:
        """Read a page through the mount (None: absent); a size mismatch is an error."""
        try:
            fd = os.open(os.path.join(self.dir, name), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            n = preadv_full(fd, segs, 0, size)
            if n != size or os.fstat(fd).st_size != size:
                raise PageSizeError(errno.EIO, f"{name}: page file is not {size} bytes")
        finally:
            os.close(fd)
        return size

    # -- writes ---------------------------------------------------------------------------
    # -- maintenance ----------------------------------------------------------------------
    def remove_all(self) -> int:
        """Delete every page file of this directory; returns how many."""
        n = 0
        try:
            self._connect()
            for name in os.listdir(self.dir):
                try:
                    os.unlink(os.path.join(self.dir, name))
                    n += 1
                except (IsADirectoryError, PermissionError, FileNotFoundError):
                    pass
        except Exception as e:         # noqa: BLE001
            self._failed("clear", e, 0)
        return n

    def close(self) -> None:
        with self._lock:
            lk, self._lookup = self._lookup, None
            leases, self._leases = self._leases + self._spares, []
            self._spares = []
            self._epoch += 1
        for c in ([lk] if lk is not None else []) + leases:
            with contextlib.suppress(OSError):
                c.close()

