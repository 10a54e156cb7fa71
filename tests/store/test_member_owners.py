"""Owners (kvfs/store/owners.py) on its own: where the fast path reads an object and who is
handed that path, over a real index, object store (tmpfs and disk tiers) and namespace."""
from __future__ import annotations

import os
import stat

import pytest

from kvfs.store.cred import ROOT, Cred
from kvfs.store.files import FileHandles
from kvfs.store.index import ROOT_INO
from kvfs.store.ownerlinks import can_grant
from kvfs.store.owners import DAEMON_UID, Owners
from support.store import open_parts

OWNER = 4242 if DAEMON_UID != 4242 else 4243


async def setup(index, store, ns, spill):
    owners = Owners(index, store, ns)
    files = FileHandles(index, store, ns, spill, owners.grants_follow_setattr)
    ns.is_open = files.is_open
    top, _ = ns.make(ROOT_INO, b"team", stat.S_IFDIR | 0o755, OWNER, OWNER)
    fh, ino, _ = await files.create(top, b"blk", 0o644, OWNER, OWNER)
    await files.write(fh, 0, os.urandom(1 << 20))
    await files.release(fh)
    return owners, files, top, ns.sealed[ino]


async def test_backing_of_names_the_highest_available_copy(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        owners, _, _, obj = await setup(index, store, ns, spill)
        tier, loc = owners.fast_copy(obj)
        assert tier is store.ram
        b = owners.backing_of(obj)
        assert b["tier"] == store.ram.name and b["size"] == obj.size and os.path.exists(b["path"])
        assert owners.backing_for(obj, ROOT) == b
        assert owners.namespace_owner(obj) == OWNER


async def test_others_get_no_path(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        owners, _, _, obj = await setup(index, store, ns, spill)
        assert owners.backing_for(obj, Cred(OWNER + 1, OWNER + 1)) is None


@pytest.mark.skipif(not can_grant(), reason="granting an owner its own link needs root")
async def test_an_owners_grant_is_taken_back_when_its_namespace_changes_owner(tmp_path):
    async with open_parts(tmp_path) as (index, store, ns, spill):
        owners, files, top, obj = await setup(index, store, ns, spill)
        b = owners.backing_for(obj, Cred(OWNER, OWNER))
        assert b is not None and b["tier"] == store.ram.name
        assert store.ram.granted() == {obj.oid: {OWNER}}
        await files.setattr(top, uid=OWNER + 1)         # chown of the namespace's directory
        assert store.ram.granted().get(obj.oid, set()) == set()
