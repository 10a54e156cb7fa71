"""The kernel transport's dispatch (kvfs/fs/handlers.py) across a daemon's restart, without the
kernel: the requests are the kernel's bytes, the answers are read back from a socket pair in
place of ``/dev/fuse``. A handle of another daemon's epoch never reaches a file (EIO; a
RELEASE and a reader's FLUSH answer 0); a resent name change that a dead daemon already made
answers as done (issue 41)."""
from __future__ import annotations

import errno
import os
import socket

import pytest

from kvfs.build import build_ops
from kvfs.fs import wire
from kvfs.fs.decoders import VERSIONED, WRITABLE
from kvfs.fs.handlers import UNIQUE_RESEND, Handlers
from kvfs.store.index import ROOT_INO
from support.store import open_store


class Wire:
    """A Handlers of one epoch over real ops; ``ask`` sends one request, returns (errno, body)."""

    def __init__(self, ops, epoch: int):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.h = Handlers(ops, self.ours.fileno(), False, epoch=epoch)
        self.unique = 2

    async def ask(self, opcode: int, nodeid: int, body: bytes, resent: bool = False):
        self.unique += 2
        unique = self.unique | (UNIQUE_RESEND if resent else 0)
        req = wire.IN_HEADER.pack(wire.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0,
                                  os.getpid(), 0, 0) + body
        await self.h.handle(memoryview(bytearray(req)))
        out = self.theirs.recv(1 << 21)
        _, err, got = wire.OUT_HEADER.unpack_from(out)
        assert got == unique
        return -err, out[wire.OUT_HEADER.size:]

    def close(self):
        self.ours.close()
        self.theirs.close()


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path) as kvstore:
        yield build_ops(kvstore, lambda: {"pid": os.getpid()})


def _create(name: bytes, flags: int) -> bytes:
    return wire.CREATE_IN.pack(flags, 0o100644, 0o022, 0) + name + b"\0"


async def test_a_handle_of_another_epoch_never_reaches_a_file(ops):
    old, new = Wire(ops, 1), Wire(ops, 2)
    try:
        err, out = await old.ask(wire.CREATE, ROOT_INO, _create(b"w", os.O_WRONLY | os.O_CREAT))
        assert err == 0
        ino = wire.ENTRY_ATTR.unpack_from(out)[0]
        wfh = wire.OPEN_OUT.unpack_from(out, wire.ENTRY_ATTR.size)[0]
        assert wfh >> 48 & 0x3FFF == 1 and wfh & WRITABLE
        err, _ = await old.ask(wire.WRITE, ino, wire.WRITE_IN.pack(wfh, 0, 5, 0, 0, 0, 0) + b"hello")
        assert err == 0
        # the next daemon's own handle numbers start again: never one of the old epoch
        err, out = await new.ask(wire.OPEN, ino, wire.OPEN_IN.pack(os.O_RDONLY, 0))
        rfh_new = wire.OPEN_OUT.unpack_from(out)[0]
        assert rfh_new >> 48 & 0x3FFF == 2 and not rfh_new & WRITABLE
        # the old writer's handle, sent to the new daemon
        err, _ = await new.ask(wire.WRITE, ino, wire.WRITE_IN.pack(wfh, 5, 1, 0, 0, 0, 0) + b"!")
        assert err == errno.EIO
        err, _ = await new.ask(wire.READ, ino, wire.READ_IN.pack(wfh, 0, 5, 0, 0, 0, 0))
        assert err == errno.EIO
        err, _ = await new.ask(wire.FLUSH, ino, wire.FLUSH_IN.pack(wfh, 0, 0, 0))
        assert err == errno.EIO                 # close(2) of the writer says its bytes are lost
        err, _ = await new.ask(wire.RELEASE, ino, wire.RELEASE_IN.pack(wfh, 0, 0, 0))
        assert err == 0
        # a reader's handle of the old epoch names its version: the new daemon opens that
        # version again and reads it; its close is no error
        err, out = await old.ask(wire.CREATE, ROOT_INO, _create(b"r", os.O_WRONLY | os.O_CREAT))
        ino = wire.ENTRY_ATTR.unpack_from(out)[0]
        fh = wire.OPEN_OUT.unpack_from(out, wire.ENTRY_ATTR.size)[0]
        await old.ask(wire.WRITE, ino, wire.WRITE_IN.pack(fh, 0, 5, 0, 0, 0, 0) + b"hello")
        await old.ask(wire.FLUSH, ino, wire.FLUSH_IN.pack(fh, 0, 0, 0))
        await old.ask(wire.RELEASE, ino, wire.RELEASE_IN.pack(fh, 0, 0, 0))
        err, out = await new.ask(wire.OPEN, ino, wire.OPEN_IN.pack(os.O_RDONLY, 0))
        rfh_new = wire.OPEN_OUT.unpack_from(out)[0]
        assert rfh_new & VERSIONED and rfh_new >> 48 & 0x3FFF == 2
        err, out = await old.ask(wire.OPEN, ino, wire.OPEN_IN.pack(os.O_RDONLY, 0))
        rfh_old = wire.OPEN_OUT.unpack_from(out)[0]
        assert rfh_old & VERSIONED and not rfh_old & WRITABLE
        err, out = await new.ask(wire.READ, ino, wire.READ_IN.pack(rfh_old, 0, 5, 0, 0, 0, 0))
        assert err == 0 and out == b"hello"
        assert new.h.files.readopened == 1
        err, _ = await new.ask(wire.FLUSH, ino, wire.FLUSH_IN.pack(rfh_old, 0, 0, 0))
        assert err == 0
        err, _ = await new.ask(wire.RELEASE, ino, wire.RELEASE_IN.pack(rfh_old, 0, 0, 0))
        assert err == 0 and not new.h.files.adopted
        err, out = await new.ask(wire.READ, ino, wire.READ_IN.pack(rfh_new, 0, 5, 0, 0, 0, 0))
        assert err == 0 and out == b"hello"
        await new.ask(wire.RELEASE, ino, wire.RELEASE_IN.pack(rfh_new, 0, 0, 0))
        # ...but once its name has another version (a runtime's temp file renamed over it),
        # the old handle never reads that one
        err, out = await new.ask(wire.CREATE, ROOT_INO, _create(b"r.tmp", os.O_WRONLY | os.O_CREAT))
        tmp_ino = wire.ENTRY_ATTR.unpack_from(out)[0]
        wfh2 = wire.OPEN_OUT.unpack_from(out, wire.ENTRY_ATTR.size)[0]
        await new.ask(wire.WRITE, tmp_ino, wire.WRITE_IN.pack(wfh2, 0, 5, 0, 0, 0, 0) + b"HELLO")
        await new.ask(wire.FLUSH, tmp_ino, wire.FLUSH_IN.pack(wfh2, 0, 0, 0))
        await new.ask(wire.RELEASE, tmp_ino, wire.RELEASE_IN.pack(wfh2, 0, 0, 0))
        assert (await new.ask(wire.RENAME, ROOT_INO, wire.RENAME_IN.pack(ROOT_INO) + b"r.tmp\0r\0"))[0] == 0
        err, _ = await new.ask(wire.READ, tmp_ino, wire.READ_IN.pack(rfh_old, 0, 5, 0, 0, 0, 0))
        assert err == errno.EIO                 # through the new inode: another oid
        # through its own inode: its version while anything keeps it (here the old daemon's
        # handle, in this one process: an orphan), else EIO; never the new bytes
        err, out = await new.ask(wire.READ, ino, wire.READ_IN.pack(rfh_old, 0, 5, 0, 0, 0, 0))
        assert (err, out) == (0, b"hello") or err == errno.EIO
    finally:
        old.close()
        new.close()


async def test_a_resent_name_change_already_made_answers_as_done(ops):
    w = Wire(ops, 3)
    try:
        mkdir = wire.MKDIR_IN.pack(0o755, 0o022) + b"d\0"
        err, out = await w.ask(wire.MKDIR, ROOT_INO, mkdir)
        assert err == 0
        ino = wire.ENTRY_ATTR.unpack_from(out)[0]
        err, _ = await w.ask(wire.MKDIR, ROOT_INO, mkdir)
        assert err == errno.EEXIST                              # not resent: the error stands
        err, out = await w.ask(wire.MKDIR, ROOT_INO, mkdir, resent=True)
        assert err == 0 and wire.ENTRY_ATTR.unpack_from(out)[0] == ino
        err, _ = await w.ask(wire.UNLINK, ROOT_INO, b"gone\0")
        assert err == errno.ENOENT
        err, _ = await w.ask(wire.UNLINK, ROOT_INO, b"gone\0", resent=True)
        assert err == 0
        err, out = await w.ask(wire.CREATE, ROOT_INO, _create(b"t", os.O_WRONLY | os.O_CREAT))
        fh = wire.OPEN_OUT.unpack_from(out, wire.ENTRY_ATTR.size)[0]
        await w.ask(wire.RELEASE, ROOT_INO, wire.RELEASE_IN.pack(fh, 0, 0, 0))
        rename = wire.RENAME_IN.pack(ROOT_INO) + b"t\0u\0"
        assert (await w.ask(wire.RENAME, ROOT_INO, rename))[0] == 0
        assert (await w.ask(wire.RENAME, ROOT_INO, rename))[0] == errno.ENOENT
        assert (await w.ask(wire.RENAME, ROOT_INO, rename, resent=True))[0] == 0
        missing = wire.RENAME_IN.pack(ROOT_INO) + b"x\0y\0"     # neither exists: not done
        assert (await w.ask(wire.RENAME, ROOT_INO, missing, resent=True))[0] == errno.ENOENT
    finally:
        w.close()
