"""The state of a file being written (shared by its writers, and readers that joined it) and
an open handle: the records of FileHandles (kvfs/store/files.py)."""
from __future__ import annotations

import dataclasses
import errno
import itertools
import time

import trio

from kvfs.errors import NamespaceError, TierFull
from kvfs.store.objects import Obj
from kvfs.store.staging import Staging

CREATE_MTIME_SLACK = 1_000_000_000   # ns: writes this soon after create() keep its mtime


@dataclasses.dataclass(eq=False)
class WriteState:
    ino: int
    staging: Staging | None = None
    base: Obj | None = None         # the sealed version the buffer started from / became
    writers: int = 0
    handles: int = 0
    # writers and truncates by path holding the state (each may seal it): the state leaves the
    # live ones when the last of them ends, never at a reader's release. A reader joins a
    # state without writers (a truncate's, or one its last writer's release is sealing); its
    # close during that seal took the state out of the live ones: the daemon reported the
    # old size and cut reads to it while the kernel had the new one (EOF inside fstat's size),
    # and a truncate or writer could start a second state on the old version meanwhile
    owners: int = 0
    dirty: bool = False
    sealing: trio.Event | None = None   # set while the buffer is being sealed: writes wait
    ready: trio.Event = dataclasses.field(default_factory=trio.Event)
    gone: trio.Event = dataclasses.field(default_factory=trio.Event)    # out of FileHandles.writers
    serial: int = dataclasses.field(default_factory=itertools.count(1).__next__)
    # the mtime reported while writing and recorded by the seal (None: the seal's time): of the
    # last write, or one set by utimens after it. A file created and written within
    # CREATE_MTIME_SLACK keeps its creation time: the kernel got that in the create reply, and
    # a different mtime later would make it drop the cached pages.
    mtime: int | None = None
    created: int = 0
    failed: str | None = None       # a write into the buffer failed: this version is never sealed
    failed_errno: int = errno.ENOSPC    # what that write got, and what close answers
    # writes and truncates of the buffer in flight (a truncate's ftruncate of a spilled buffer
    # runs in a thread): a seal waits for them (``quiet``), else it hashed a buffer whose file
    # a truncate had already cut (mmap past the file's end: the flush failed, close gave EIO)
    # or sealed without a change the kernel was then told had happened
    changes: int = 0
    quiet: trio.Event | None = None

    def change_ended(self) -> None:
        self.changes -= 1
        if not self.changes and self.quiet is not None:
            self.quiet.set()

    async def wait_quiet(self) -> None:
        """Until no write or truncate of the buffer is in flight (new ones wait for
        ``sealing``, which the caller has set)."""
        while self.changes:
            self.quiet = trio.Event()
            await self.quiet.wait()
        self.quiet = None

    def touch(self) -> None:
        """A write or truncate changed the buffer now."""
        now = time.time_ns()
        if now - self.created > CREATE_MTIME_SLACK:
            self.mtime = now


@dataclasses.dataclass(eq=False)
class Handle:
    ino: int
    write: bool = False
    append: bool = False            # writes go to the end of the buffer (see KvfsOperations)
    ws: WriteState | None = None    # writers and readers of a file being written
    obj: Obj | None = None          # readers of a sealed version

    def content_key(self) -> tuple[str, int]:
        """What this handle reads: a sealed object, or one write state's buffer."""
        return ("obj", self.obj.oid) if self.obj is not None else ("ws", self.ws.serial)


def write_errno(e: BaseException) -> int:
    """The errno a failed piece of a write got (kvfs.fs.errmap's mapping of store errors)."""
    if isinstance(e, (NamespaceError, OSError)) and e.errno:
        return e.errno
    if isinstance(e, TierFull):
        return errno.ENOSPC
    return errno.EIO


def failed_error(ws: "WriteState") -> NamespaceError:
    return NamespaceError(ws.failed_errno, f"a write to this file failed, not sealed ({ws.failed})")
