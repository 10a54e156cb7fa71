"""vLLM and LMCache rows of benchmarks/runtime_adapters.py: each runtime's own file backend and
the kvfs adapter, driven the way the runtime's controller drives them (tests/integration/
drivers.py), with the operations of the SGLang rows (set, get, exists hits, exists miss).

vLLM: its ``fs`` secondary tier (as shipped: 16 read and 16 write threads, its pure-Python I/O
path) against ``KvfsTierManager``. set = cascade jobs of 128 chunks (one per scheduler step's
worth of a long prefill), all submitted, then polled; get = promotion jobs of 128 chunks;
exists = one request's lookup of all chunks, stepped until the tier's lookup thread answered.

LMCache: its ``fs`` L2 adapter (aiofiles) against ``KvfsL2Adapter``. set = store tasks of 128
objects; get = one prefetch of all objects (lookup_and_lock, load, unlock: a prefetch is not
complete without the lock); exists = one lookup_and_lock task (then unlocked).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from support.drivers import LmcacheController, vllm_tier
from support.released import L1Object


def spin(predicate, timeout: float, what: str):
    """Poll ``predicate`` with no sleep between tries (a scheduler that steps; its own loop)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0)

POOL = 128         # primary-tier / L1 slots: chunks cycle through them
BATCH = 128        # chunks per store / load job


def _clear(d: Path) -> None:
    """Remove what is inside ``d`` (not ``d``: the adapters keep it open)."""
    if not d.is_dir():
        return
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name != "config.json":
            p.unlink(missing_ok=True)


class VllmRow:
    def __init__(self, v, name: str, kind: str, directory: Path, page_bytes: int, n: int):
        self.name, self.v, self.n, self.pb = name, v, n, page_bytes
        conf = {"type": "fs"} if kind == "own" else {"type": "KvfsTierManager", "module_path": "kvfs.integrations.vllm"}
        self.d = vllm_tier(v, {**conf, "root_dir": str(directory)}, chunks=POOL, chunk_bytes=page_bytes, wait=spin,
                           model="bench/model")
        self.want = self.d.fill(range(POOL), seed=1)
        self.dir = Path(f"{self.d.tier.file_mapper.base_path}_r{self.d.tier.file_mapper.rank}")
        self.gen = 0

    def keys(self, tag=None) -> list:
        tag = self.gen if tag is None else tag
        mk = self.v.base.make_offload_key
        return [mk(hashlib.sha256(f"{tag}:{i}".encode()).digest(), 0) for i in range(self.n)]

    def _jobs(self, promotion: bool) -> None:
        keys = self.keys()
        ids = [self.d.submit(keys[i:i + BATCH], [j % POOL for j in range(i, min(i + BATCH, self.n))], promotion)
               for i in range(0, self.n, BATCH)]
        res = self.d.finish(ids)
        assert all(r.success for r in res), f"{self.name}: a {'load' if promotion else 'store'} job failed"

    def set(self) -> float:
        _clear(self.dir)
        self.gen += 1
        t0 = time.perf_counter()
        self._jobs(False)
        return time.perf_counter() - t0

    def get(self) -> float:
        t0 = time.perf_counter()
        self._jobs(True)
        return time.perf_counter() - t0

    def check(self) -> None:
        assert self.d.read(range(POOL)) == self.want, f"{self.name}: a chunk read back differs"

    def exists_hits(self) -> float:
        keys = self.keys()
        t0 = time.perf_counter()
        k = self.d.hits(keys)
        dt = time.perf_counter() - t0
        assert k == self.n, f"{self.name}: {k} of {self.n} chunks found"
        return dt

    def exists_miss(self) -> float:
        keys = self.keys("absent")
        t0 = time.perf_counter()
        for k in keys:
            assert self.d.hits([k]) == 0
        return time.perf_counter() - t0

    def finish(self, ts: dict) -> dict:
        out = {op: statistics.median(v) for op, v in ts.items()}
        if hasattr(self.d.tier, "statistics"):
            out["counters"] = self.d.tier.statistics().__dict__
        _clear(self.dir)
        self.d.tier.shutdown()
        return out


class LmcacheRow:
    def __init__(self, lm, name: str, kind: str, directory: Path, page_bytes: int, n: int):
        self.name, self.lm, self.n, self.pb = name, lm, n, page_bytes
        if kind == "own":
            spec = {"type": "fs", "base_path": str(directory)}
        else:
            spec = {"type": "plugin", "module_path": "kvfs.integrations.lmcache", "class_name": "KvfsL2Adapter",
                    "adapter_params": {"base_path": str(directory)}}
        parser = lm.config.add_l2_adapters_args(argparse.ArgumentParser())
        (conf,) = lm.config.parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)])) \
            .adapters
        self.a = lm.factory.create_l2_adapter_from_registry(conf)
        self.c = LmcacheController(lm, self.a, spin, arena_bytes=POOL * page_bytes)
        self.want = self.c.fill(self.c.objs(POOL, page_bytes), seed=1)
        self.objs = [L1Object(self.c.arena, (i % POOL) * page_bytes, page_bytes) for i in range(n)]
        self.dir = directory
        self.gen = 0

    def keys(self, tag=None) -> list:
        tag = self.gen if tag is None else tag
        return [self.lm.api.ObjectKey(chunk_hash=hashlib.sha256(f"{tag}:{i}".encode()).digest(),
                                      model_name="bench/model", kv_rank=0) for i in range(self.n)]

    def set(self) -> float:
        _clear(self.dir)
        self.gen += 1
        keys = self.keys()
        batches = [(keys[i:i + BATCH], self.objs[i:i + BATCH]) for i in range(0, self.n, BATCH)]
        t0 = time.perf_counter()
        res = self.c.store_many(batches)
        dt = time.perf_counter() - t0
        assert all(r.is_successful() for r in res), f"{self.name}: a store task failed"
        return dt

    def get(self) -> float:
        t0 = time.perf_counter()
        got = self.c.prefetch(self.keys(), self.objs)
        dt = time.perf_counter() - t0
        assert got == self.n, f"{self.name}: prefetch got {got} of {self.n}"
        return dt

    def check(self) -> None:
        got = [o.raw_data.numpy().tobytes() for o in self.objs[:POOL]]
        assert got == self.want[:len(got)], f"{self.name}: an object read back differs"

    def exists_hits(self) -> float:
        keys = self.keys()
        t0 = time.perf_counter()
        k = self.c.lookup(keys).count_leading_ones()
        dt = time.perf_counter() - t0
        self.a.submit_unlock(keys)
        assert k == self.n, f"{self.name}: {k} of {self.n} objects found"
        return dt

    def exists_miss(self) -> float:
        keys = self.keys("absent")
        t0 = time.perf_counter()
        for k in keys:
            assert self.c.lookup([k]).popcount() == 0
        return time.perf_counter() - t0

    def finish(self, ts: dict) -> dict:
        out = {op: statistics.median(v) for op, v in ts.items()}
        if hasattr(self.a, "statistics"):
            out["counters"] = self.a.statistics().__dict__
        _clear(self.dir)
        self.a.close()
        return out


def make_rows(runtime: str, mod, dirs: dict, page_bytes: int, n: int, names: tuple) -> list:
    """The three rows of ``runtime`` (own backend on the plain dir, on kvfs, the kvfs adapter)."""
    cls = {"vllm": VllmRow, "lmcache": LmcacheRow}[runtime]
    kinds = ("own", "own", "kvfs")
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    return [cls(mod, name, kind, dirs[name], page_bytes, n) for name, kind in zip(names, kinds)]
