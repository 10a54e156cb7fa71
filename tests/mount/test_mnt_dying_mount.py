"""Issue 32 (4): a mount that dies between a client's check and its act leaves nothing under
the bare mount point. Each test kills the daemon (and detaches its mount) right in the window
-- after the client found its directory on kvfs, before it writes there -- and makes the same
directories on the disk below, where a write by path would then land."""
from __future__ import annotations

import errno
import os

import pytest

from support.files import MiB, read

pytestmark = pytest.mark.mount


def _die(m, *shadow) -> None:
    """Kill the daemon, detach its mount, and make ``shadow`` directories below it."""
    m.kill9()
    for d in shadow:
        os.makedirs(d, exist_ok=True)


def _files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def test_namespace_metadata_is_not_written_under_a_dead_mount(kvfs_mount, monkeypatch):
    from kvfs.kv import layout
    lay = layout.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype="float16")
    m = kvfs_mount()
    real = layout.makedirs_under

    def made_then_died(root, path):
        dev = real(root, path)
        _die(m, path)                       # the namespace directory, now on the bare disk
        return dev
    monkeypatch.setattr(layout, "makedirs_under", made_then_died)
    with pytest.raises(OSError) as e:
        layout.open_namespace(str(m.path), "model", lay, "sha256_cbor")
    assert e.value.errno in (errno.ENOTCONN, errno.ENOENT)
    assert _files_under(m.path) == [], "namespace.json was written under the bare mount point"


def test_page_written_through_the_mount_is_not_written_under_a_dead_mount(kvfs_mount):
    from kvfs.integrations.pages import PageStore
    m = kvfs_mount()
    store = PageStore(m.path / "pages", use_commit=False)
    page = os.urandom(64 << 10)
    assert store.write_many(["sub/p0"], lambda i: [page]) == [True]
    assert read(m.path / "pages" / "sub" / "p0") == page
    real, died = store._connect, []

    def connected_then_died():
        lk = real()
        if not died:
            died.append(1)
            _die(m, m.path / "pages" / "sub")
        return lk
    store._connect = connected_then_died
    try:
        with pytest.raises(OSError) as e:
            store._write("sub/p1", [page])      # the window: after its check of the mount
        assert e.value.errno in (errno.ENOTCONN, errno.ENOENT)
        assert died and _files_under(m.path) == [], "the page was written under the bare mount point"
    finally:
        store.close()


def test_commit_into_a_dead_mount_makes_nothing_under_it(kvfs_mount):
    """``CommitClient`` acts only through descriptors it opened on the mount (its root, the
    control file): killed after it connected, its commits fail and make no directory below."""
    from kvfs.kv.commit import CommitClient
    m = kvfs_mount()
    c = CommitClient(str(m.path))
    try:
        assert c.commit_into("", [("a/b/f", [bytearray(b"x" * MiB)])]) == [0]
        _die(m, m.path / "a" / "b")
        with pytest.raises(OSError):
            c.commit_into("", [("a/b/g", [bytearray(b"y" * MiB)]), ("c/d/g", [bytearray(b"z" * 10)])])
        with pytest.raises(OSError):
            c.makedirs("c/d")
        assert _files_under(m.path) == [] and sorted(os.listdir(m.path)) == ["a"]
    finally:
        c.close()


def test_block_writer_of_a_mount_dead_since_the_lookup_writes_nothing_under_it(kvfs_mount, monkeypatch):
    """KVCache found its namespace on kvfs, then the daemon died before its writer opened the
    mount's root: the root is opened and checked through itself (ENOTCONN), never the bare
    mount point's directory, under which every block would then have been written."""
    torch = pytest.importorskip("torch")
    import kvfs
    from kvfs.kv import writer
    lay = kvfs.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype="float16")
    m = kvfs_mount()
    real, died = writer.CommitClient.open, []

    def died_then_opened(root):
        if not died:                        # the namespace's directory, made again below
            died.append(root)
            _die(m, *[m.path / n for n in os.listdir(m.path)])
        return real(root)
    monkeypatch.setattr(writer.CommitClient, "open", staticmethod(died_then_opened))
    with pytest.raises(OSError) as e:
        cache = kvfs.KVCache(m.path, model="m", layout=lay)
        try:                                # (before: the cache started, and wrote here)
            cache.save(list(range(32)), torch.zeros(lay.block_shape(32)).to(lay.torch_dtype))
            cache.flush()
        finally:
            cache.close()
    assert died and e.value.errno in (errno.ENOTCONN, errno.ENOENT)
    assert _files_under(m.path) == [], "blocks were written under the bare mount point"
