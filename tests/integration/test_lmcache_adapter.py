"""The kvfs LMCache L2 adapter, driven by LMCache 0.5.6's released L2 adapter layer.

The adapter is created by LMCache's own ``plugin`` L2 adapter factory from the recipe's
``--l2-adapter`` JSON (parsed by LMCache's released argument parser), beside LMCache's own
``fs`` L2 adapter on the same directory, and driven the way LMCache's store and prefetch
controllers drive an L2 adapter: submit a task, wait on the adapter's event fd, pop or query
its result; a prefetch is lookup_and_lock, load of the locked prefix, unlock. See
tests/support/released.py.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import threading
from pathlib import Path

import pytest
import torch

from kvfs.proc import pid_alive
from support.drivers import LmcacheController
from support.mount import lazy_unmount, wait_for
from support.released import load_lmcache, load_sglang, storage_config

pytestmark = pytest.mark.mount

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
PLUGIN = {"type": "plugin", "module_path": "kvfs.integrations.lmcache", "class_name": "KvfsL2Adapter"}


@pytest.fixture(scope="module")
def lm():
    lm = load_lmcache()
    import kvfs.integrations.lmcache  # noqa: F401 -- importable once LMCache is
    return lm


@pytest.fixture
def adapters():
    made = []
    yield made
    for a in made:
        a.close()


def _parse(lm, spec: dict):
    """``--l2-adapter JSON`` through LMCache's released parser: the adapter config."""
    parser = lm.config.add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    (cfg,) = lm.config.parse_args_to_l2_adapters_config(args).adapters
    return cfg


def _adapter(lm, adapters, base, **params):
    a = lm.factory.create_l2_adapter_from_registry(_parse(lm, {**PLUGIN, "adapter_params": {
        "base_path": str(base), **params}}))
    adapters.append(a)
    return LmcacheController(lm, a, wait_for)


def _keys(lm, n, salt="a", model="org/Model-8B", rank=0, cache_salt=""):
    return [lm.api.ObjectKey(chunk_hash=f"{salt}{i}".encode().ljust(32, b"\0"), model_name=model, kv_rank=rank,
                             cache_salt=cache_salt) for i in range(n)]


def _read(objs) -> list[bytes]:
    return [o.raw_data.numpy().tobytes() for o in objs]


def test_objects_round_trip(lm, kvfs_mount, adapters):
    """Store, lookup_and_lock (one lease request), load from the pinned files, unlock: every
    object equal, misses are misses, a vanished object ends the hit run."""
    m = kvfs_mount(ram="128MiB")
    c = _adapter(lm, adapters, m.path / "lmcache")
    n = 32                                   # two parts of 16 for the adapter's reader threads
    src, dst = c.objs(n, MIB), c.objs(n, MIB, first=n)
    want = c.fill(src, seed=1)
    keys = _keys(lm, n)
    res = c.store(keys, src)
    assert res.is_successful() and res.bytes_transferred() == n * MIB
    bm = c.lookup(keys + _keys(lm, 3, "b"))
    assert bm.get_indices_list() == list(range(n))
    got = c.load(keys, dst)
    c.a.submit_unlock(keys)
    assert got.popcount() == n and _read(dst) == want
    assert c.lookup(_keys(lm, 2, "b") + keys).popcount() == 0
    st = c.a.statistics()
    assert (st.hits, st.misses, st.lease_fallbacks, st.errors) == (n, 0, 0, 0)
    assert st.lookups == 1 + 2          # the store's own lookup, then one lease per lookup_and_lock
    # an unlocked load leases by itself
    for o in dst:
        o.raw_data.zero_()
    assert c.load(keys, dst).popcount() == n and _read(dst) == want
    # a vanished object ends the hit run; the others load
    os.unlink(Path(c.a.store.dir) / lm.fs._object_key_to_filename(keys[4]))
    assert c.prefetch(keys, dst) == 4
    assert c.a.report_status()["locked_keys"] == 0
    # a vanished object in the second part: the load's bitmap has exactly that bit clear
    os.unlink(Path(c.a.store.dir) / lm.fs._object_key_to_filename(keys[20]))
    got = c.load(keys, dst)
    assert got.get_indices_list() == [i for i in range(n) if i not in (4, 20)]


def test_lock_pins_objects_until_unlock(lm, kvfs_mount, adapters):
    """What lookup_and_lock found stays in the RAM tier (leased) while the tier fills up
    with other objects; the load reads the pinned files; after unlock they may move."""
    m = kvfs_mount(ram="8MiB")
    c = _adapter(lm, adapters, m.path / "lmcache")
    locked, other = _keys(lm, 4, "l"), _keys(lm, 12, "o")
    want = c.fill(c.objs(4, MIB), seed=2)
    assert c.store(locked, c.objs(4, MIB)).is_successful()
    tier = lambda k: os.getxattr(Path(c.a.store.dir) / lm.fs._object_key_to_filename(k), "user.kvfs.tier")  # noqa
    assert {tier(k) for k in locked} == {b"ram"}
    assert c.lookup(locked).popcount() == 4
    c.fill(c.objs(12, MIB, first=4), seed=3)
    assert c.store(other, c.objs(12, MIB, first=4)).is_successful()
    assert {tier(k) for k in locked} == {b"ram"}            # pinned by the lock
    dst = c.objs(4, MIB, first=16)
    assert c.load(locked, dst).popcount() == 4 and _read(dst) == want
    assert c.a.statistics().lease_fallbacks == 0
    c.a.submit_unlock(locked)
    wait_for(lambda: c.a.report_status()["locked_keys"] == 0, 60, "the unlock")


def test_shares_a_directory_with_lmcaches_fs_adapter(lm, kvfs_mount, adapters):
    """LMCache's own ``fs`` L2 adapter and the kvfs one on one directory read each other's
    objects."""
    m = kvfs_mount(ram="128MiB")
    base = m.path / "shared"
    kv = _adapter(lm, adapters, base)
    fs_adapter = lm.factory.create_l2_adapter_from_registry(_parse(lm, {"type": "fs", "base_path": str(base)}))
    adapters.append(fs_adapter)
    fs = LmcacheController(lm, fs_adapter, wait_for)
    a, b = _keys(lm, 5, "fs"), _keys(lm, 5, "kv")
    want_a = fs.fill(fs.objs(5, MIB), seed=4)
    assert fs.store(a, fs.objs(5, MIB)).is_successful()
    want_b = kv.fill(kv.objs(5, MIB), seed=5)
    assert kv.store(b, kv.objs(5, MIB)).is_successful()
    assert kv.prefetch(a, kv.objs(5, MIB, first=5)) == 5 and _read(kv.objs(5, MIB, first=5)) == want_a
    assert fs.prefetch(b, fs.objs(5, MIB, first=5)) == 5 and _read(fs.objs(5, MIB, first=5)) == want_b
    assert kv.a.statistics().lease_fallbacks == 0


def test_small_objects_and_nvme_tier(lm, kvfs_mount, adapters):
    """128 KiB objects (under ``ram_mapped_min``, too small to lease: one .kvfs/get) and 1 MiB objects demoted
    to the NVMe tier (pinned O_DIRECT files)."""
    m = kvfs_mount(ram="8MiB")
    c = _adapter(lm, adapters, m.path / "lmcache")
    small = _keys(lm, 20, "s")
    want = c.fill(c.objs(20, 128 << 10), seed=6)
    assert c.store(small, c.objs(20, 128 << 10)).is_successful()
    assert c.prefetch(small, c.objs(20, 128 << 10, first=20)) == 20
    assert _read(c.objs(20, 128 << 10, first=20)) == want
    st = c.a.statistics()      # too small to lease: all 20 in one .kvfs/get, none through the mount
    assert (st.batch_reads, st.lease_fallbacks) == (20, 0)
    big = _keys(lm, 16, "n")
    want = c.fill(c.objs(16, MIB), seed=7)
    assert c.store(big, c.objs(16, MIB)).is_successful()
    tiers = {os.getxattr(Path(c.a.store.dir) / lm.fs._object_key_to_filename(k), "user.kvfs.tier") for k in big}
    assert b"nvme" in tiers
    assert c.prefetch(big, c.objs(16, MIB, first=16)) == 16 and _read(c.objs(16, MIB, first=16)) == want
    st = c.a.statistics()
    assert st.lease_fallbacks == 0 and st.batch_reads == 20 and st.errors == 0


def test_killed_daemon_mid_run_gives_misses(lm, kvfs_mount, adapters):
    """A prefetch loop while the daemon is SIGKILLed: misses (0 bits) and failed stores,
    never an exception; nothing written under the dead mount point; a new daemon is picked
    up by itself."""
    m = kvfs_mount(ram="64MiB")
    c = _adapter(lm, adapters, m.path / "lmcache")
    n = 8
    want = c.fill(c.objs(n, MIB), seed=8)
    keys = _keys(lm, n)
    assert c.store(keys, c.objs(n, MIB)).is_successful()
    results, stop, errors = [], threading.Event(), []

    def prefetcher():
        try:
            while not stop.is_set():
                results.append(c.prefetch(keys, c.objs(n, MIB, first=n)))
        except BaseException as e:      # noqa: BLE001 -- reported below
            errors.append(e)
    t = threading.Thread(target=prefetcher, name="lmcache-prefetch")
    t.start()
    try:
        wait_for(lambda: results or not t.is_alive(), 60, "a first prefetch")
        assert results[0] == n
        m.kill9()
        seen = len(results)
        wait_for(lambda: (len(results) >= seen + 3 and results[-1] == 0) or not t.is_alive(), 60,
                 "misses after the kill")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert results[-1] == 0
    assert not c.store(_keys(lm, 2, "late"), c.objs(2, MIB)).is_successful()
    assert os.listdir(m.path) == []
    st = c.a.statistics()
    assert st.errors > 0 and st.reconnects > 0
    m.mount()                                    # a new daemon: the RAM tier's objects died
    assert c.lookup(keys).popcount() == 0
    assert c.store(keys, c.objs(n, MIB)).is_successful()
    assert c.prefetch(keys, c.objs(n, MIB, first=n)) == n and _read(c.objs(n, MIB, first=n)) == want


def test_unmount_gives_misses(lm, kvfs_mount, adapters):
    """A lazily unmounted mount: misses, failed stores, nothing written under the mount
    point, and the detached daemon exits (spare lease descriptors closed)."""
    m = kvfs_mount()
    c = _adapter(lm, adapters, m.path / "lmcache")
    keys = _keys(lm, 4)
    c.fill(c.objs(4, MIB), seed=9)
    assert c.store(keys, c.objs(4, MIB)).is_successful()
    assert c.prefetch(keys, c.objs(4, MIB, first=4)) == 4
    pid = m.pid
    lazy_unmount(m.path)
    assert c.prefetch(keys, c.objs(4, MIB, first=4)) == 0
    assert c.load(keys, c.objs(4, MIB, first=4)).popcount() == 0
    assert not c.store(_keys(lm, 2, "u"), c.objs(2, MIB)).is_successful()
    assert os.listdir(m.path) == []
    wait_for(lambda: not pid_alive(pid), 60, "the detached daemon to exit")


def test_key_isolation(lm, kvfs_mount, adapters):
    """Model, KV rank and cache salt separate objects (LMCache's key scheme: all are in the
    file name); SGLang's adapter on the same directory never sees LMCache's objects for the
    same chunk hash, nor LMCache SGLang's pages."""
    m = kvfs_mount(ram="128MiB")
    base = m.path / "cache"
    c = _adapter(lm, adapters, base)
    keys = _keys(lm, 3)
    c.fill(c.objs(3, MIB), seed=10)
    assert c.store(keys, c.objs(3, MIB)).is_successful()
    assert c.lookup(keys).popcount() == 3
    c.a.submit_unlock(keys)
    for other in (dict(model="org/Other"), dict(rank=1), dict(cache_salt="tenant2")):
        assert c.lookup(_keys(lm, 3, **other)).popcount() == 0, other
    sg = load_sglang()
    pool = sg.HostPool(pages=6, page_size=MIB // (2 * 4 * 4 * 64 * 2), layer_num=4, head_num=4, head_dim=64,
                       layout="page_first")
    extra = {"backend_name": "kvfs", "module_path": "kvfs.integrations.sglang", "class_name": "KvfsHiCacheStorage",
             "interface_v1": 1, "root": str(base)}
    backend = sg.StorageBackendFactory.create_backend(
        "dynamic", storage_config(sg.hicache_storage, model="org/Model-8B", extra=extra, layout="page_first"), pool)
    backend.register_mem_pool_host(pool)
    try:
        skeys = [k.chunk_hash.hex() for k in keys]
        assert backend.batch_exists(skeys) == 0
        ctl = sg.Controller(backend, pool, backend_type="dynamic", extra_config=extra)
        assert ctl.backup(skeys, torch.arange(0, 3 * pool.page_size)) == 3 * pool.page_size
        assert backend.batch_exists(skeys) == 3
        assert c.lookup(_keys(lm, 3)).popcount() == 3      # still only its own three
        c.a.submit_unlock(_keys(lm, 3))
    finally:
        backend.close()


def test_bad_adapter_params_are_clear_errors(lm, tmp_path):
    for params, what in (({}, "base_path"), ({"base_path": str(tmp_path), "n_threads": "4"}, "n_threads"),
                         ({"base_path": str(tmp_path), "verify_shm": "never"}, "verify_shm"),
                         ({"base_path": str(tmp_path), "colour": 1}, "unknown")):
        with pytest.raises(ValueError, match=what):
            lm.factory.create_l2_adapter_from_registry(_parse(lm, {**PLUGIN, "adapter_params": params}))


def _recipe() -> list[str]:
    text = (REPO / "docs" / "integrations.md").read_text()
    block = re.search(r"<!-- recipe:lmcache -->\s*```sh\n(.*?)```", text, re.S).group(1)
    line = next(cmd for cmd in block.replace("\\\n", " ").splitlines() if "lmcache server" in cmd)
    return shlex.split(line)


def _released_flags(*paths: Path) -> set[str]:
    """Every ``add_argument("--flag", ...)`` of the released source files."""
    flags = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def test_recipe_as_documented(lm, kvfs_mount, adapters):
    """docs/integrations.md's LMCache command: ``lmcache server`` adds the storage manager's
    arguments, every flag of the recipe is one of them, and its ``--l2-adapter``, parsed by
    LMCache's released L2 argument parser, makes a working kvfs adapter through the released
    plugin factory."""
    argv = _recipe()
    assert argv[:2] == ["lmcache", "server"]
    server = (lm.pkg / "cli" / "commands" / "server.py").read_text()
    assert "add_storage_manager_args" in server
    flags = _released_flags(lm.pkg / "v1" / "distributed" / "config.py",
                            lm.pkg / "v1" / "distributed" / "l2_adapters" / "config.py")
    opts = [a for a in argv[2:] if a.startswith("--")]
    assert opts and all(f in flags for f in opts), set(opts) - flags
    float(argv[argv.index("--l1-size-gb") + 1])
    cfg = _parse(lm, json.loads(argv[argv.index("--l2-adapter") + 1]))
    m = kvfs_mount()
    cfg.adapter_params["base_path"] = str(m.path / "lmcache")     # the recipe's /mnt/kvfs, here
    a = lm.factory.create_l2_adapter_from_registry(cfg)
    adapters.append(a)
    assert type(a).__module__ == "kvfs.integrations.lmcache"
    c = LmcacheController(lm, a, wait_for)
    want = c.fill(c.objs(2, MIB), seed=11)
    assert c.store(_keys(lm, 2), c.objs(2, MIB)).is_successful()
    assert c.prefetch(_keys(lm, 2), c.objs(2, MIB, first=2)) == 2 and _read(c.objs(2, MIB, first=2)) == want


def test_256k_objects_leased_under_the_default_ram_mapped_min(lm, kvfs_mount, adapters):
    """Under the default ``ram_mapped_min`` (256 KiB), 256 KiB objects stay RAM-tier files: the
    lock pins them and the load reads them beside FUSE (no ``.kvfs/get``, no lease fallback)."""
    m = kvfs_mount(ram="64MiB")
    c = _adapter(lm, adapters, m.path / "lmcache")
    keys = _keys(lm, 20, "s")
    want = c.fill(c.objs(20, 256 << 10), seed=12)
    assert c.store(keys, c.objs(20, 256 << 10)).is_successful()
    assert c.prefetch(keys, c.objs(20, 256 << 10, first=20)) == 20
    assert _read(c.objs(20, 256 << 10, first=20)) == want
    st = c.a.statistics()
    assert (st.hits, st.batch_reads, st.lease_fallbacks, st.errors) == (20, 0, 0, 0)


def test_ram_mapped_min_is_checked():
    from kvfs.config import Config, ConfigError
    for bad in (0, 100, 1 << 31, "256KiB"):
        with pytest.raises(ConfigError, match="ram_mapped_min"):
            Config(ram_mapped_min=bad).validate()
