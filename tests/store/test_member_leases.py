"""Leases (kvfs/store/leases.py) on its own: the batched prefix lookup and fast-path leases,
over a real index, object store and namespace, with Owners for the backing paths."""
from __future__ import annotations

import errno
import json
import os

import pytest
import trio

from kvfs.errors import NamespaceError
from kvfs.store.cred import Cred
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.leases import LEASE_TTL_MAX_USER, Leases
from kvfs.store.owners import Owners
from support.store import open_parts


async def build(index, store, ns, spill, n: int = 3) -> Leases:
    owners = Owners(index, store, ns)
    files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
    ns.is_open = files.is_open
    for i in range(n):
        fh, _, _ = await files.create(ROOT_INO, b"b%d" % i, 0o600, 0, 0)
        await files.write(fh, 0, os.urandom(256 << 10))
        await files.release(fh)
    return Leases(index, store, ns, owners)


async def test_prefix_ends_at_the_first_missing_path(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        leases = await build(index, store, ns, spill)
        objs = leases.prefix_objects([b"b0", b"b1", b"nope", b"b2"])
        assert [o.ino for o in objs] == [ns.find(ROOT_INO, b"b0"), ns.find(ROOT_INO, b"b1")]
        assert leases.prefix_answer(objs) == {"prefix": 2, "tiers": [store.ram.name] * 2}
        assert leases.prefix_objects([b"b0"], cred=Cred(1000, 1000)) == []     # mode 0600, root's


async def test_a_lease_holds_its_objects_until_released(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        leases = await build(index, store, ns, spill)
        lid, raw = leases.grant([b"b0", b"b1", b"b2"])
        answer = json.loads(raw)
        assert answer["lease"] == lid and answer["prefix"] == 3 and len(answer["blocks"]) == 3
        assert all(b[0] == store.ram.name for b in answer["blocks"])
        objs = leases.live[lid].objs
        assert all(o.refs == 1 for o in objs)
        assert await leases.release(lid) and leases.live == {}
        assert all(o.refs == 0 for o in objs)
        assert not await leases.release(lid)


async def test_leases_expire(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        leases = await build(index, store, ns, spill, n=1)
        lid, _ = leases.grant([b"b0"], ttl=0.01)
        obj = leases.live[lid].objs[0]
        with trio.fail_after(10):
            while await leases.expire() == 0:
                await trio.sleep(0.01)
        assert leases.live == {} and obj.refs == 0
        with pytest.raises(NamespaceError) as e:
            leases.grant([b"b0"], ttl=0)
        assert e.value.errno == errno.EINVAL
        lid, raw = leases.grant([b"b0"], ttl=LEASE_TTL_MAX_USER * 2, cred=Cred(1000, 1000))
        assert json.loads(raw)["ttl"] == LEASE_TTL_MAX_USER
        await leases.release(lid)
