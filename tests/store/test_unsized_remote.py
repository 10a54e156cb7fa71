"""A file larger than the NVMe tier while the remote tier has been down since the mount (its
capacity not known yet): no EFBIG -- the remote tier may hold it once it is reached."""
from __future__ import annotations

import errno
import socket
import uuid

import pytest

from kvfs.errors import NamespaceError
from kvfs.remote import make_volume
from kvfs.remote.tier import RemoteTier
from kvfs.store.index import ROOT_INO
from support.store import file_remote_tier, open_store

MiB = 1 << 20


def down_remote_tier() -> RemoteTier:
    """A remote tier whose target refuses connections (a bound port nobody listens on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        iid = uuid.uuid4().hex
        vol = make_volume(f"nvme-tcp://127.0.0.1:{port}/nqn.2014-08.org.kvfs:test", instance_id=iid)
        return RemoteTier(vol, instance_id=iid, size="256MiB", format=True, describe="down")


async def truncate_to(kvstore, size: int) -> None:
    fh, _, _ = await kvstore.files.create(ROOT_INO, b"big", 0o644, 0, 0)
    try:
        await kvstore.files.setattr(kvstore.index.lookup(ROOT_INO, b"big"), size=size)
    finally:
        await kvstore.files.release(fh)


async def test_no_efbig_while_the_remote_tier_is_unsized(tmp_path):
    remote = down_remote_tier()
    async with open_store(tmp_path, ram=1 * MiB, nvme=2 * MiB, extra_tiers=[remote]) as kvstore:
        assert remote.state == "disconnected" and not remote.sized
        assert kvstore.files.max_file_size() > 2 * MiB
        await truncate_to(kvstore, 8 * MiB)           # fits the remote's 256 MiB: no EFBIG


async def test_efbig_past_every_known_tier(tmp_path):
    remote = await file_remote_tier(tmp_path)       # 64 MiB, reached
    async with open_store(tmp_path, ram=1 * MiB, nvme=2 * MiB, extra_tiers=[remote]) as kvstore:
        assert remote.sized and kvstore.files.max_file_size() == remote.capacity
        with pytest.raises(NamespaceError) as e:
            await truncate_to(kvstore, remote.capacity + 1)
        assert e.value.errno == errno.EFBIG
