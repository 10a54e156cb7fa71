"""The index's record format: typed CBOR, versioned, refused clearly when damaged.

``fixtures/index_v2`` is an index written by format 2 when it was introduced (a
directory, a file with an xattr and a KV record, its object): every later version of
the code must still open it, or refuse it by version with a message naming fsck.
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import cbor2
import pytest

from support.store import plant_record
from kvfs.errors import IndexDamaged
from kvfs.store import records
from kvfs.store.index import ROOT_INO, Index, k64

FIXTURE = Path(__file__).parent / "fixtures" / "index_v2"


@pytest.fixture
def state(tmp_path):
    d = tmp_path / "state"
    shutil.copytree(FIXTURE, d)
    return d


def test_opens_an_index_of_format_2(state):
    ix = Index(state)
    try:
        assert ix.instance_id == "0123456789abcdef0123456789abcdef"
        d = ix.lookup(ROOT_INO, b"blocks")
        f = ix.lookup(d, b"abc.bin")
        rec = ix.get_inode(f)
        assert rec.size == 5 and rec.oid == 7 and rec.uid == 1000
        assert rec.xattrs == {b"user.note": b"hello"} and rec.kv["hash"] == "abc"
        obj = ix.get_object(7)
        assert obj.place == {"nvme": b""} and obj.key == "/blocks/abc.bin" and obj.atime == 1.5
        assert ix.verify_records() == 4
    finally:
        ix.close()


class _Boom:
    def __reduce__(self):
        return (os.abort, ())


def test_a_pickled_record_is_refused(state):
    plant_record(state, b"objects", k64(7), pickle.dumps({"size": 5, "x": _Boom()}))
    ix = Index(state)
    try:
        with pytest.raises(IndexDamaged, match="kvfs fsck"):
            ix.get_object(7)
        with pytest.raises(IndexDamaged):
            ix.verify_records()
    finally:
        ix.close()


@pytest.mark.parametrize("bad", [
    {"mode": "0644"},                           # wrong type
    {"name": "str-not-bytes"},
    {"xattrs": {"user.a": b"v"}},               # map key of the wrong type
    {"extra": object},                          # not a plain value (encoded below as a tag)
])
def test_a_record_of_the_wrong_shape_is_refused(bad):
    good = dict(mode=0o100644, uid=0, gid=0, size=0, nlink=1, atime=0, mtime=0, ctime=0, parent=1,
                name=b"n", xattrs={})
    rec = dict(good, **bad)
    if bad.get("extra") is object:
        raw = cbor2.dumps(dict(good, extra=cbor2.CBORTag(4242, [1])))
    else:
        raw = cbor2.dumps(rec)
    with pytest.raises(IndexDamaged):
        records.decode_inode(raw)
    assert records.decode_inode(cbor2.dumps(good)).name == b"n"


def test_an_unknown_format_version_is_refused(state):
    doc = records.decode_meta((state / "index.hdr").read_bytes())
    doc["version"] = 99
    (state / "index.hdr").write_bytes(cbor2.dumps(doc))
    with pytest.raises(IndexDamaged, match="format 99 .*kvfs fsck"):
        Index(state)


def test_a_header_checksum_mismatch_is_refused(state):
    doc = records.decode_meta((state / "index.hdr").read_bytes())
    doc["instance"] = "f" * 32
    (state / "index.hdr").write_bytes(cbor2.dumps(doc))
    with pytest.raises(IndexDamaged, match="checksum"):
        Index(state)


def test_a_truncated_file_is_refused_not_mapped(state):
    data = state / "index.lmdb" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)
    with pytest.raises(IndexDamaged, match="truncated"):
        Index(state)


def test_a_vanished_index_is_not_recreated_empty(state):
    shutil.rmtree(state / "index.lmdb")
    with pytest.raises(IndexDamaged, match="missing or empty"):
        Index(state)


def test_new_state_is_private(tmp_path):
    ix = Index(tmp_path / "fresh")
    ix.close()
    assert os.stat(tmp_path / "fresh").st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / "fresh" / "index.lmdb" / "data.mdb").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "fresh" / "index.hdr").st_mode & 0o777 == 0o600
