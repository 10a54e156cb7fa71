"""How each open is answered to the kernel: cached pages kept or dropped, ``direct_io``, or
FUSE passthrough (kvfs/fs/passthrough.py), from what is open on the inode.

The kernel keeps one page cache per inode, but an inode can have several versions open at
once (an old reader, a writer): what the cached pages hold and which versions are open is
tracked here, so no handle is served another version's pages. Under the kernel transport an
inode is also in one kernel I/O mode at a time: *cached* (the page cache: a handle without
``direct_io``) or *passthrough* (one backing file); a handle of the other mode fails in the
kernel with EIO, so a passthrough open is given only while the inode has no cached handle,
and every other open is ``direct_io`` while it is in passthrough.

The kernel leaves an open's mode when its file is released, before it sends RELEASE, so a
handle still counted here may already be gone in the kernel (a writer's close: FLUSH, then
RELEASE queued). A read-only open that finds only such closing handles (FLUSH seen, nothing
written since) waits a moment (``CLOSING_WAIT``) for their RELEASE before choosing: the usual
write-then-read of a block is then served by passthrough; a handle that stays open (a dup'd
descriptor, a mapping) makes the open a cached one, as without passthrough.

A backing file is registered only for the inode's current sealed version, with no writer and
no size change under way (:meth:`Opens._current`, checked after the open's last wait, in the
same step as the registration). The kernel keeps one size per inode, the last the daemon told
it (the current version's), and a passthrough descriptor's ``fstat`` shows that size while its
reads and faults stop at the backing file's end: a version the open chose before a wait (the
NVMe copy's check, ``CLOSING_WAIT``) and that a rewrite or truncate replaced meanwhile is an
older version, whose descriptor must read zeros past its bytes up to that size (docs/design.md,
"Versions and sizes"), not EOF or SIGBUS (a 6 MiB backing file under a 10 MiB inode). Such an
open is served by the daemon, which pads it. A change that passed :meth:`Opens.changeable`
but has not yet begun (it waits for a seal) is marked (:meth:`Opens.changing`) so that no
registration slips in before it: once registered, every size change of the inode is refused
(ETXTBSY) until the last passthrough open goes, so the two sizes stay equal.
"""
from __future__ import annotations

import contextlib
import logging
import os

import pyfuse3
import trio

from kvfs.errors import NamespaceError
from kvfs.store.backing import open_backing

log = logging.getLogger(__name__)

CLOSING_WAIT = 0.2      # seconds a read-only open waits for closing cached handles' RELEASE
HELD_WAIT = 0.5         # seconds a change waits for the passthrough opens of its inode to go
RENEW_HOLD = 1.0        # seconds a renewed inode declines passthrough while its rewrite's retry comes
EMPTY = ("empty", 0)    # a page_key: the kernel holds no page of the inode (created, only direct I/O since)


def same_version(a, b) -> bool:
    """Whether two objects are the same sealed version (the object table may hold another
    instance of one: compare ids)."""
    return a is not None and b is not None and (a is b or a.oid == b.oid)


def write_only(h, flags: int) -> bool:
    """A handle that can only write (O_WRONLY: it can neither read nor be mapped)."""
    return h.write and flags & os.O_ACCMODE == os.O_WRONLY


class Held(Exception):
    """An inode held by passthrough opens of one version: another open of it (a writer, or a
    reader of another version) or a change of its size fails with ETXTBSY where the file
    cannot be renewed instead (Renewed)."""


class Replaced(Exception):
    """A read-only open chose a version, waited, and meanwhile a newer version became the
    inode's current one and was registered for passthrough (the kernel then takes only
    passthrough opens of the inode). The open has not returned to its caller yet, so it is
    opened again and reads the current version (kvfs/fs/ops.py ``open``), instead of ETXTBSY."""


class Renewed(Exception):
    """A change by a name (an open for writing or truncating, a truncate by path) of a file
    whose sealed version readers hold (through passthrough or, since stop 38, the daemon: one
    inode, one page cache, one backing file per version): its name was given a new inode
    with the same version, the readers keep the old one (kvfs/store/namespace.py
    ``renew``). Answered ESTALE: the kernel
    looks the name up again (LOOKUP_REVAL) and retries the change once, on the new inode.
    ``entry``: (parent, name) whose kernel entry goes; None when the inode had been renewed
    (or evicted) already."""

    def __init__(self, entry: tuple[int, bytes] | None):
        super().__init__(entry)
        self.entry = entry


class Opens:
    def __init__(self, store):
        self.store = store
        self.passthrough = None                 # kvfs.fs.passthrough.Passthrough (kernel transport)
        self.page_key: dict[int, tuple] = {}    # inode -> whose bytes its cached pages hold
        self.open_keys: dict[int, dict[tuple, int]] = {}
        self.fh_key: dict[int, tuple[int, tuple]] = {}
        self.uncached_fh: set[int] = set()      # writes that may bypass or disagree with the pages
        self.cached: dict[int, set[int]] = {}   # inode -> its handles in the kernel's cached mode
        self.closing: set[int] = set()          # cached handles flushed, nothing written since
        # direct_io handles whose OPEN answer the kernel may not have applied yet (no request
        # of theirs seen since): inode -> handles (see _may_pass)
        self.unseen: dict[int, set[int]] = {}
        self._gone: dict[int, trio.Event] = {}  # inode -> set when its last cached handle goes
        self._changing: dict[int, int] = {}     # inode -> changes past changeable, not yet begun
        self.waited = self.waits_timed_out = 0
        self.renewing: dict[int, float] = {}    # renewed inode -> until when it declines passthrough
        self.renews = 0

    async def file_info(self, fh: int, ino: int, flags: int = 0) -> pyfuse3.FileInfo:
        """keep_cache when the cached pages hold this handle's version (sealed objects never
        change); direct_io while another version of the inode is open (mmap then gives ENODEV)
        or while the kernel reads the inode through passthrough."""
        h = self.store.files.handles[fh]
        key = h.content_key()
        passing = await self._pass(fh, ino, h)
        if not passing and self.passthrough is not None and self.passthrough.mode(ino) is not None:
            held = self.passthrough.mode(ino)
            if not h.write and not same_version(held, h.obj) and self._current(ino, held):
                raise Replaced(ino)
            if not h.write:
                # a reader refused: rare, and worth knowing why (tests/fsx/probe_concurrent.py)
                log.warning("read-only open of inode %d refused (ETXTBSY): held by version %s, "
                            "this one %s, writers %s, renewing %s, changing %s, current %s", ino,
                            getattr(held, "oid", None), getattr(h.obj, "oid", None),
                            ino in self.store.files.writers, self._renewing(ino),
                            self._changing.get(ino), h.obj is not None and self._current(ino, h.obj))
            raise Held(ino)         # the kernel takes only passthrough opens of it now
        keys = self.open_keys.setdefault(ino, {})
        others = any(k != key for k in keys)
        keys[key] = keys.get(key, 0) + 1
        self.fh_key[fh] = (ino, key)
        if passing:
            return pyfuse3.FileInfo(fh=fh)
        pt = self.passthrough
        # a reader of a renewed inode before the change that renewed it came back: that
        # change goes on beside it (not renewed twice), so it reads uncached, where another
        # version's pages cannot reach it
        direct = (others or (self.renewing and not h.write and self._renewing(ino))
                  or (pt is not None and (pt.mode(ino) is not None or pt.enabled and write_only(h, flags))))
        if direct or flags & (os.O_DIRECT | os.O_APPEND):
            self.uncached_fh.add(fh)
        if direct:
            if pt is not None and pt.enabled:
                self.unseen.setdefault(ino, set()).add(fh)
            if flags & os.O_APPEND and self.page_key.get(ino) == EMPTY:
                # its offsets are the daemon's (the buffer's end), maybe not the size the
                # kernel computes: the seal then tells the kernel (kvfs/fs/coherence.py)
                del self.page_key[ino]
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        # O_APPEND through the page cache: the kernel resolves write(2)'s append offset from
        # its size, and a shared mapping's writeback through this handle carries its page's
        # own offset, so the offset it sends is right (a direct_io handle cannot be mapped,
        # and the kernel's size may be another open version's: it appends at its buffer's end)
        h.append = False
        self.cached.setdefault(ino, set()).add(fh)
        keep = self.page_key.get(ino) == key
        self.page_key[ino] = key
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    async def _pass(self, fh: int, ino: int, h) -> bool:
        """Whether this open is served by the kernel from the object's tier file: a read-only
        open of a sealed version with no write in progress (see the module's text)."""
        pt = self.passthrough
        if pt is None or not pt.enabled or h.obj is None or h.write or ino in self.store.files.writers:
            return False
        if self._renewing(ino):
            return False
        if not await self._may_pass(ino, h.obj, wait=True):
            return False
        if same_version(pt.mode(ino), h.obj) and self._current(ino, h.obj):
            # the inode's registration already serves this version: another reader of it
            # shares that backing (nothing to open or check: a copy moving meanwhile does not
            # matter, the kernel holds the registered file)
            return pt.offer(fh, ino, h.obj, None)
        if self._may_reuse(ino, h.obj):
            # the registration the inode's last passthrough open left idle: the same version,
            # its copy still the top one (nothing to open, check or register)
            return pt.offer(fh, ino, h.obj, None)
        store = self.store.store
        for _ in range(2):
            found = await open_backing(store, h.obj)
            if found is None:
                pt.declined += 1
                return False
            fd, tier = found
            if store.top_tier(h.obj) == tier:
                break
            # promoted (this open queued it) or moved while its copy was checked: that copy
            # is no longer the top one, and its drop or promotion hook ran before there was a
            # registration to close; the top copy instead (a RAM copy needs no check)
            os.close(fd)
        else:
            pt.declined += 1
            return False
        if not await self._may_pass(ino, h.obj, wait=False) or not self._current(ino, h.obj):
            os.close(fd)                     # another open, a writer or a new version came in meanwhile
            return False
        return pt.offer(fh, ino, h.obj, fd, tier)

    def _may_reuse(self, ino: int, obj) -> bool:
        """Whether ``ino``'s idle registration may serve an open of ``obj``: the inode's
        current version (:meth:`_current`), the object live and not being moved, and the copy
        it registered still the object's top one (a promotion, a demotion or a drop closes
        it too, before the copy goes: kvfs/fs/passthrough.py)."""
        kept = self.passthrough.kept(ino)
        if kept is None or not same_version(kept.obj, obj) or not self._current(ino, obj):
            return False
        store = self.store.store
        if kept.tier != store.ram.name:
            # a lower tier's copy is checked at every registration: bytes that rotted on the
            # disk since the last check are EIO, never given (a RAM copy was written by the
            # daemon or checked when promoted)
            return False
        if obj.dead or obj.corrupt or obj.busy or kept.tier not in obj.place or store.top_tier(obj) != kept.tier:
            return False
        tier = next(t for t in store.tiers if t.name == kept.tier)
        return tier.available and tier.backing(obj.oid, obj.place[kept.tier]) is not None

    def copy_dropped(self, oid: int) -> None:
        """The store's ``on_copy_dropped``: a copy of ``oid`` is about to be freed or is no
        longer its top copy (wired by kvfs.build.build_ops)."""
        if self.passthrough is not None:
            self.passthrough.copy_dropped(oid)

    def _read(self, ino: int) -> bool:
        """Whether descriptors of ``ino``'s sealed, non-empty version are open, and no writer:
        a new version on the same inode would share the kernel's one page cache with them (a
        ``direct_io`` reader's ``MAP_PRIVATE`` mapping fills it with the new version's pages,
        which an older reader's cached reads then return: docs/design.md, "Versions and
        sizes"), so a change by a name renews it, as for passthrough readers. An empty
        version's readers (an ``O_RDONLY|O_CREAT`` of a new name) follow the file instead."""
        if not self.open_keys.get(ino) or ino in self.store.files.writers:
            return False
        try:
            return self.store.files.getattr(ino).size > 0
        except NamespaceError:
            return False

    def held(self, ino: int) -> bool:
        """Whether passthrough opens hold ``ino`` (the kernel then takes no other open of it)."""
        return self.passthrough is not None and self.passthrough.mode(ino) is not None

    def renewed(self, ino: int) -> None:
        """``ino`` is the new inode a held file's name was given (``changeable``): the change
        that asked for it comes back to it once the kernel has looked the name up again, so
        until then (at most RENEW_HOLD s) a reader of it is not given passthrough, which would
        hold it again and send that change back a second time."""
        now = trio.current_time()
        if len(self.renewing) > 256:
            self.renewing = {i: t for i, t in self.renewing.items() if t > now}
        self.renewing[ino] = now + RENEW_HOLD
        self.renews += 1

    def _renewing(self, ino: int) -> bool:
        until = self.renewing.get(ino)
        if until is None:
            return False
        if trio.current_time() < until:
            return True
        del self.renewing[ino]
        return False

    def _current(self, ino: int, obj) -> bool:
        """Whether ``obj`` is the inode's current sealed version, of the size the kernel was
        told, with no writer and no change of it under way: the only version whose tier file
        may back the inode (see the module's text; sync, so it holds until the registration
        made in the same step)."""
        if ino in self.store.files.writers or self._changing.get(ino):
            return False
        try:
            rec = self.store.files.getattr(ino)
        except NamespaceError:
            return False
        return rec.oid == obj.oid and rec.size == obj.size

    async def changeable(self, ino: int, renew: bool = False) -> None:
        """Raise Held unless ``ino`` may get a new version: no passthrough open holds it (one
        just closed is waited for: the kernel sends RELEASE after the close returned).
        ``renew``: the change came by a name (not a descriptor): a held file is renewed
        instead where it can be (raise Renewed; what cannot, a held inode with no name left,
        stays Held)."""
        if renew and self.store.names.evicted(ino):
            raise Renewed(None)                 # renewed (or evicted) meanwhile: look it up again
        if renew and (self.held(ino) or (self._read(ino) and not self._renewing(ino))):
            moved = self.store.names.renew(ino)
            if moved is not None:
                parent, name, new = moved
                self.renewed(new)
                log.debug("renewed %r: inode %d -> %d (held by passthrough readers)", name, ino, new)
                raise Renewed((parent, name))
        self.renewing.pop(ino, None)            # the change a renewal waited for has come
        pt = self.passthrough
        if pt is not None and pt.mode(ino) is not None and not await pt.unheld(ino, HELD_WAIT):
            pt.busy += 1
            raise Held(ino)

    @contextlib.asynccontextmanager
    async def changing(self, ino: int, renew: bool = False):
        """:meth:`changeable`, then no passthrough registration of ``ino`` until the change
        the block makes has begun (a writer's open, a truncate: each may wait for a seal
        before its write state exists, and a reader registered in that wait would be left
        with a backing file of another size than the inode's)."""
        await self.changeable(ino, renew)
        self._changing[ino] = self._changing.get(ino, 0) + 1
        try:
            yield
        finally:
            n = self._changing.pop(ino) - 1
            if n:
                self._changing[ino] = n

    async def _may_pass(self, ino: int, obj, wait: bool) -> bool:
        held = self.passthrough.mode(ino)
        if held is not None and not same_version(held, obj):
            return False
        if held is None and self.unseen.get(ino):
            # a direct_io open answered but maybe not yet applied by the kernel (its opener
            # may run after this one's): the kernel refuses any open that is not passthrough
            # once the inode has a backing file, so that opener would get EIO
            return False
        handles = self.cached.get(ino)
        if not handles:
            return True
        if not wait or not handles <= self.closing:
            return False
        self.waited += 1
        gone = self._gone.setdefault(ino, trio.Event())
        with trio.move_on_after(CLOSING_WAIT):
            await gone.wait()
        if self.cached.get(ino):
            self.waits_timed_out += 1
            return False
        held = self.passthrough.mode(ino)
        return held is None or same_version(held, obj)

    def created(self, ino: int) -> None:
        """A new inode (CREATE): no page of it in the kernel until a cached open reads or
        writes one (its file_info replaces the key; a direct_io writer leaves it)."""
        self.page_key[ino] = EMPTY

    def seen(self, fh: int) -> None:
        """A request through ``fh`` (READ, WRITE, FLUSH): the kernel has applied its OPEN."""
        if self.unseen:
            ino, _ = self.fh_key.get(fh, (None, None))
            self._unseen_gone(ino, fh)

    def _unseen_gone(self, ino, fh: int) -> None:
        handles = self.unseen.get(ino)
        if handles is not None:
            handles.discard(fh)
            if not handles:
                del self.unseen[ino]

    def flushed(self, fh: int) -> None:
        """FLUSH (a close(2) of one of the handle's descriptors)."""
        ino, _ = self.fh_key.get(fh, (None, None))
        if self.unseen:
            self._unseen_gone(ino, fh)
        if ino is not None and fh in self.cached.get(ino, ()):
            self.closing.add(fh)

    def writing(self, fh: int) -> None:
        """A WRITE through ``fh``: it is not closing, and the pages may not hold what it writes."""
        self.closing.discard(fh)
        if self.unseen:
            self.seen(fh)
        if fh in self.uncached_fh:
            ino, key = self.fh_key.get(fh, (None, None))
            if self.page_key.get(ino) == key:
                del self.page_key[ino]

    def closed(self, fh: int) -> None:
        """RELEASE of ``fh``."""
        self.uncached_fh.discard(fh)
        self.closing.discard(fh)
        ino, key = self.fh_key.pop(fh, (None, None))
        if ino is None:
            return
        if self.unseen:
            self._unseen_gone(ino, fh)
        handles = self.cached.get(ino)
        if handles is not None and fh in handles:
            handles.discard(fh)
            if not handles:
                del self.cached[ino]
                gone = self._gone.pop(ino, None)
                if gone is not None:
                    gone.set()
        keys = self.open_keys.get(ino, {})
        n = keys.get(key, 1) - 1
        if n:
            keys[key] = n
        else:
            keys.pop(key, None)
        if not keys:
            self.open_keys.pop(ino, None)
            if self.page_key.get(ino) == EMPTY:
                del self.page_key[ino]

    def statistics(self) -> dict:
        return {"waited_for_release": self.waited, "wait_timed_out": self.waits_timed_out,
                "renewed": self.renews}
