"""setuid/setgid kills without the kernel (issue 40, item 5): the rule (kvfs/fs/killpriv.py),
what INIT asks for, and the handlers applying the kernel's flags to the store's records. The
same cases against the machine's ext4 through a real mount: tests/mount/test_mnt_killpriv.py."""
from __future__ import annotations

import os
import stat
import types

import pyfuse3
import pytest

from kvfs.build import build_ops
from kvfs.fs import wire
from kvfs.fs.decoders import Fields, SessionDecoder
from kvfs.fs.killpriv import Killer, kept_mode
from kvfs.fs.passthrough import Passthrough
from kvfs.store.index import ROOT_INO
from support.store import open_store

REG = stat.S_IFREG
ROOT = types.SimpleNamespace(uid=0, gid=0, pid=os.getpid(), umask=0o022)


def who(gid: int = 100, groups=(), capable: bool = False) -> Killer:
    k = Killer(1000, gid, os.getpid(), capable)
    k._groups = frozenset(groups)
    return k


@pytest.mark.parametrize("mode, file_gid, caller, want", [
    (0o4777, 0, who(), 0o777),                       # suid always goes
    (0o2777, 0, who(), 0o777),                       # sgid with group-exec goes
    (0o2767, 0, who(), 0o767),                       # sgid without: goes for an outsider
    (0o2767, 100, who(gid=100), 0o2767),             # ... kept for the file's group
    (0o2767, 7, who(groups=(7,)), 0o2767),           # ... and a supplementary member
    (0o2767, 0, who(capable=True), 0o2767),          # ... and CAP_FSETID (a chown by root)
    (0o6755, 0, who(capable=True), 0o0755),          # a chown by root: suid, sgid+gx go
    (0o0777, 0, who(), 0o0777),
])
def test_the_rule(mode, file_gid, caller, want):
    assert kept_mode(REG | mode, file_gid, caller) == REG | want
    assert kept_mode(stat.S_IFDIR | mode, file_gid, caller) == stat.S_IFDIR | mode   # files only


def test_a_write_by_a_capable_caller_keeps_the_bits():
    assert who(capable=True).write_kept(REG | 0o6777, 0) == REG | 0o6777
    assert who().write_kept(REG | 0o6777, 0) == REG | 0o777


def _init_body(flags: int) -> bytes:
    offered = flags | wire.INIT_EXT
    return wire.INIT_IN.pack(7, 45, 1 << 20, offered & 0xFFFFFFFF, offered >> 32) + bytes(44)


@pytest.mark.parametrize("offered, want, killpriv", [
    (wire.HANDLE_KILLPRIV | wire.HANDLE_KILLPRIV_V2, wire.HANDLE_KILLPRIV_V2, 2),
    (wire.HANDLE_KILLPRIV, wire.HANDLE_KILLPRIV, 1),       # a kernel without v2 (before 5.11)
])
async def test_init_asks_for_killpriv_v2_where_the_kernel_offers_it(offered, want, killpriv):
    ops = types.SimpleNamespace(privs=types.SimpleNamespace(contract=None))
    dec = SessionDecoder(Passthrough(-1, False), ops=ops)
    out = (await dec.init(0, _init_body(offered), ROOT))[0]
    fields = wire.INIT_OUT.unpack(out)
    got = fields[3] | fields[10] << 32
    assert got & (wire.HANDLE_KILLPRIV | wire.HANDLE_KILLPRIV_V2) == want
    assert ops.privs.contract == killpriv


@pytest.fixture
async def ops(tmp_path):
    async with open_store(tmp_path) as kvstore:
        yield build_ops(kvstore, lambda: {"pid": os.getpid()})


async def _file(ops, mode: int) -> int:
    fi, attr = await ops.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, ROOT)
    await ops.write(fi.fh, 0, b"data")
    await ops.release(fi.fh)
    ino = attr.st_ino
    await ops.store.files.setattr(ino, mode=mode)
    return ino


def _mode(ops, ino) -> int:
    return stat.S_IMODE(ops.store.files.getattr(ino).mode)


async def test_v2_kills_where_the_kernel_says_and_only_there(ops):
    ops.privs.contract = 2
    other = types.SimpleNamespace(uid=4321, gid=4321, pid=os.getpid(), umask=0o022)
    ino = await _file(ops, 0o6777)
    fi = await ops.open(ino, os.O_WRONLY, other, kill=False)
    await ops.write(fi.fh, 0, b"x")                          # no flag: a capable writer
    assert _mode(ops, ino) == 0o6777
    await ops.write(fi.fh, 0, b"x", other)                    # FUSE_WRITE_KILL_SUIDGID
    assert _mode(ops, ino) == 0o777
    await ops.release(fi.fh)
    # a truncate with FATTR_KILL_SUIDGID, one without
    await ops.store.files.setattr(ino, mode=0o6777)
    await ops.setattr(ino, _attrs(size=1), Fields(wire.FATTR_SIZE), None, ROOT)
    assert _mode(ops, ino) == 0o6777
    await ops.setattr(ino, _attrs(size=0), Fields(wire.FATTR_SIZE | wire.FATTR_KILL_SUIDGID), None, other)
    assert _mode(ops, ino) == 0o777


async def test_v1_kills_on_a_write_by_an_opener_without_cap_fsetid(ops):
    assert ops.privs.contract == 1                             # the pyfuse3 transport's
    ino = await _file(ops, 0o4755)
    fi = await ops.open(ino, os.O_WRONLY, ROOT)               # this process: root, CAP_FSETID
    await ops.write(fi.fh, 0, b"x")
    assert _mode(ops, ino) == 0o4755
    await ops.release(fi.fh)
    gone = types.SimpleNamespace(uid=4321, gid=4321, pid=1 << 22, umask=0)   # no such process
    fi = await ops.open(ino, os.O_WRONLY, gone)
    await ops.write(fi.fh, 0, b"x")
    assert _mode(ops, ino) == 0o755
    await ops.release(fi.fh)


def _attrs(size: int):
    a = pyfuse3.EntryAttributes()
    a.st_size = size
    return a
