"""The runtimes' released code, fetched from PyPI and loaded without their GPU stacks.

``wheel(pkg, version)`` downloads ``pkg==version`` with ``pip download --no-deps`` into a
cache outside the checkout (``$KVFS_WHEEL_CACHE``, default ``~/.cache/kvfs/wheels``) once;
``unpack`` extracts only the files the storage layer needs from it.

SGLang (``load_sglang``): its ``hicache_storage.py`` (HiCacheStorage, HiCacheFile), the
storage backend factory and the file backend's evictor are imported as they are, from the
wheel's files, under their real module names. What is skipped is only the package
``__init__`` files that pull in SGLang's GPU stack (``sglang/__init__.py``,
``sglang/srt/utils/__init__.py``). Two things the storage layer touches live in modules that
import CUDA-only code (``pool_host/mha.py``: the host KV pool; ``managers/cache_controller.py``:
the threads that drive storage); from those, the released *functions* the storage path runs
(the host pool's page accessors, the controller's batch loops, ``human_readable_int``) are
taken from the wheel's source by name (``released_defs``) and executed unchanged -- nothing is
re-implemented. Only the host pool's constructor (CUDA pointer tables and pinned allocators)
is replaced by :class:`HostPool`, which allocates ``kv_buffer`` with the released shapes.
"""
from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import threading
import types
import zipfile
from pathlib import Path
from queue import Queue

import torch

log = logging.getLogger(__name__)

CACHE = Path(os.environ.get("KVFS_WHEEL_CACHE", Path.home() / ".cache" / "kvfs" / "wheels"))
SGLANG_VERSION = "0.5.23"
PIP_TIMEOUT = 900


def wheel(pkg: str, version: str) -> Path:
    """The released wheel of ``pkg==version`` in the cache, downloaded once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    norm = pkg.replace("-", "_")
    found = sorted(CACHE.glob(f"{norm}-{version}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{pkg}=={version}", "-d", str(CACHE)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
        if res.returncode:
            raise RuntimeError(f"pip download {pkg}=={version} failed: {res.stderr.strip()[-400:]}")
        found = sorted(CACHE.glob(f"{norm}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"no wheel of {pkg}=={version} in {CACHE}")
    return found[-1]


def unpack(whl: Path, members: list[str]) -> Path:
    """Extract the files under ``members`` (paths or folder prefixes) of ``whl`` into the
    cache (once); returns the directory that holds them."""
    dest = CACHE.parent / "runtimes" / whl.stem
    stamp = dest / ".kvfs-unpacked"
    want = "\n".join(sorted(members))
    if stamp.exists() and stamp.read_text() == want:
        return dest
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if any(n == m or (m.endswith("/") and n.startswith(m)) for m in members)]
        for m in members:
            if not any(n == m or n.startswith(m) for n in names):
                raise RuntimeError(f"{whl.name} has no {m}")
        z.extractall(dest, names)
    stamp.write_text(want)
    return dest


def released_defs(path: Path, names: list[str], namespace: dict, cls: str | None = None) -> dict:
    """Execute the top-level definitions ``names`` (or the methods ``names`` of class ``cls``)
    of the released source file ``path`` in ``namespace``; returns the namespace. The code
    object carries the file's own name and line numbers."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    picked = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    missing = set(names) - {n.name for n in picked}
    if missing:
        raise RuntimeError(f"{path}: no {sorted(missing)}")
    mod = ast.Module(body=[ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0), *picked],
                     type_ignores=[])
    ast.fix_missing_locations(mod)
    exec(compile(mod, str(path), "exec"), namespace)
    return namespace


# -- SGLang -----------------------------------------------------------------------------
SGLANG_FILES = [
    "sglang/srt/environ.py",
    "sglang/srt/mem_cache/hicache_storage.py",
    "sglang/srt/mem_cache/storage/__init__.py",
    "sglang/srt/mem_cache/storage/backend_factory.py",
    "sglang/srt/mem_cache/storage/file/",
    "sglang/srt/mem_cache/pool_host/mha.py",
    "sglang/srt/managers/cache_controller.py",
    "sglang/srt/utils/common.py",
    "sglang/srt/arg_groups/fields/memory.py",
]
_sglang_lock = threading.Lock()


def _package(name: str, path: Path) -> None:
    """Register package ``name`` at ``path`` without running its ``__init__``."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    mod.__package__ = name
    sys.modules[name] = mod


def load_sglang(version: str = SGLANG_VERSION) -> types.SimpleNamespace:
    """Import SGLang's released storage layer; returns its modules and released pieces."""
    with _sglang_lock:
        root = unpack(wheel("sglang", version), SGLANG_FILES)
        pkg = root / "sglang"
        if "sglang" not in sys.modules or getattr(sys.modules["sglang"], "__path__", [None])[0] != str(pkg):
            _package("sglang", pkg)
            _package("sglang.srt.utils", pkg / "srt" / "utils")
            common = types.ModuleType("sglang.srt.utils.common")
            ns = common.__dict__
            exec("import argparse, re\nfrom decimal import Decimal", ns)
            released_defs(pkg / "srt" / "utils" / "common.py", ["human_readable_int"], ns)
            sys.modules["sglang.srt.utils.common"] = common
        import importlib
        hs = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        factory = importlib.import_module("sglang.srt.mem_cache.storage.backend_factory")
        return types.SimpleNamespace(root=root, pkg=pkg, version=version, hicache_storage=hs,
                                     StorageBackendFactory=factory.StorageBackendFactory,
                                     HostPool=_host_pool_class(pkg), Controller=_controller_class(pkg, hs))


def storage_config(hs, *, model="org/Model-8B", tp_rank=0, tp_size=1, mla=False, layout="layer_first",
                   extra=None, metrics=False):
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=layout != "layer_first",
        model_name=model, extra_config=extra)


def _host_pool_class(pkg: Path):
    """MHATokenToKVPoolHost's released page accessors over a CPU ``kv_buffer`` allocated with
    the shapes of its ``init_kv_buffer``."""
    ns = {"torch": torch}
    released_defs(pkg / "srt" / "mem_cache" / "pool_host" / "mha.py",
                  ["get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page", "get_page_buffer_meta"],
                  ns, cls="MHATokenToKVPoolHost")

    class HostPool:
        get_data_page = ns["get_data_page"]
        get_dummy_flat_data_page = ns["get_dummy_flat_data_page"]
        set_from_flat_data_page = ns["set_from_flat_data_page"]
        get_page_buffer_meta = ns["get_page_buffer_meta"]

        def __init__(self, *, pages: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                     layout: str = "layer_first", dtype=torch.bfloat16):
            self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layer_num, head_num, head_dim
            self.v_head_dim = head_dim
            self.layout, self.dtype, self.device, self.pin_memory = layout, dtype, "cpu", False
            self.size = pages * page_size
            self.page_num = pages
            dims = {
                "layer_first": (2, layer_num, self.size, head_num, head_dim),
                "page_first": (2, self.size, layer_num, head_num, head_dim),
                "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
                "page_head": (2, pages, head_num, page_size, layer_num, head_dim),
            }[layout]
            self.kv_buffer = torch.zeros(dims, dtype=dtype)
            self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]

        @property
        def page_bytes(self) -> int:
            return 2 * self.layer_num * self.page_size * self.head_num * self.head_dim * self.dtype.itemsize

        def fill(self, index: int, seed: int) -> torch.Tensor:
            """Write a distinct pattern into the page at token ``index``; returns its flat copy."""
            g = torch.Generator().manual_seed(seed)
            data = torch.randint(-30000, 30000, (self.page_bytes // 2,), dtype=torch.int16, generator=g)
            self.set_from_flat_data_page(index, data.view(self.dtype))
            return self.get_data_page(index, flat=True).clone()

    return HostPool


def _controller_class(pkg: Path, hs):
    """SGLang's HiCacheController storage path: its released batch loops (``_page_transfer``,
    ``_page_backup``, the page get/set functions) on the threads it runs them on."""
    path = pkg / "srt" / "managers" / "cache_controller.py"
    ns = {"torch": torch, "threading": threading, "time": __import__("time"),
          "logging": logging, "logger": logging.getLogger("sglang.cache_controller"),
          "STORAGE_BATCH_SIZE": hs.STORAGE_BATCH_SIZE, "HiCacheStorageExtraInfo": hs.HiCacheStorageExtraInfo,
          "PoolName": hs.PoolName, "PoolTransfer": hs.PoolTransfer, "count_pool_hits": hs.count_pool_hits}
    exec("from dataclasses import dataclass\nfrom typing import Any, List, Optional", ns)
    released_defs(path, ["PrefetchAck", "StorageOperation", "PrefetchOperation"], ns)
    methods = ["_page_get_zero_copy", "_generic_page_get", "_page_transfer", "_page_transfer_kv_batch",
               "_generic_page_set", "_page_set_zero_copy", "_page_backup"]
    released_defs(path, methods, ns, cls="HiCacheController")

    class Controller:
        """Holds what those methods read: backend, host pool, page size, queues."""

        STORAGE_BATCH_SIZE = hs.STORAGE_BATCH_SIZE
        PrefetchOperation = ns["PrefetchOperation"]
        StorageOperation = ns["StorageOperation"]

        def __init__(self, backend, host_pool, *, backend_type: str, extra_config: dict | None):
            self.storage_backend = backend
            self.storage_host_pool = self.mem_pool_host = host_pool
            self.page_size = host_pool.page_size
            self.prefetch_sync_queue: Queue = Queue()
            # the released selection rule (HiCacheController.attach_storage_backend)
            zero_copy = backend_type == "dynamic" and bool((extra_config or {}).get("interface_v1", 0))
            self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
            self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set

        def hit_query(self, page_hashes: list[str], prefix_keys=None) -> list[str]:
            """The prefetch thread's existence query (``_storage_hit_query`` after hashing):
            batches of STORAGE_BATCH_SIZE, stopping at the first short batch."""
            hits: list[str] = []
            for start in range(0, len(page_hashes), self.STORAGE_BATCH_SIZE):
                batch = page_hashes[start:start + self.STORAGE_BATCH_SIZE]
                info = hs.HiCacheStorageExtraInfo(prefix_keys=prefix_keys)
                k = self.storage_backend.batch_exists(batch, info)
                hits += batch[:k]
                if k < len(batch):
                    break
                if prefix_keys is not None:
                    prefix_keys = prefix_keys + batch
            return hits

        def prefetch(self, rid: str, hashes: list[str], host_indices: torch.Tensor) -> int:
            """The io-aux thread's transfer of one prefetch operation; pages completed."""
            op = self.PrefetchOperation(rid, [], prefix_keys=[])
            op.hash_value = list(hashes)
            op.host_indices = host_indices
            return self._page_transfer(op)

        def backup(self, hashes: list[str], host_indices: torch.Tensor) -> int:
            """The backup thread's write of one operation; tokens completed."""
            op = self.StorageOperation(host_indices, [], hash_value=list(hashes), prefix_keys=[])
            self._page_backup(op)
            return op.completed_tokens

        def on_thread(self, fn, *args, name: str = "hicache-io"):
            """Run ``fn(*args)`` on a thread of its own (as the controller's workers do);
            returns its result, re-raising what escaped it."""
            out: dict = {}

            def run():
                try:
                    out["value"] = fn(*args)
                except BaseException as e:      # noqa: BLE001 -- reported to the caller
                    out["error"] = e
            t = threading.Thread(target=run, name=name)
            t.start()
            t.join()
            if "error" in out:
                raise out["error"]
            return out["value"]

    for m in methods:
        setattr(Controller, m, ns[m])
    return Controller


# -- vLLM -------------------------------------------------------------------------------
VLLM_VERSION = "0.33.0"
MSGSPEC_VERSION = "0.22.0"        # a dependency of vllm.v1.kv_hints (ReqContext's hints)
_OFFLOADING = "vllm/distributed/kv_transfer/kv_connector/v1/offloading"
VLLM_FILES = [
    "vllm/envs.py", "vllm/logger.py", "vllm/logging_utils/", "vllm/v1/__init__.py", "vllm/v1/kv_hints/",
    "vllm/v1/kv_offload/", "vllm/v1/metrics/", "vllm/v1/kv_cache_layout.py", f"{_OFFLOADING}/canonical_mapping.py",
    # read (not imported) by the recipe test
    f"{_OFFLOADING}/scheduler.py", "vllm/distributed/parallel_state.py", "vllm/engine/arg_utils.py", "vllm/distributed/kv_transfer/kv_connector/factory.py",
    "vllm/config/kv_transfer.py",
]
# Packages whose __init__ pulls in the GPU/distributed stack: registered bare.
_VLLM_BARE = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
              "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.offloading"]
_vllm_lock = threading.Lock()


def load_vllm(version: str = VLLM_VERSION) -> types.SimpleNamespace:
    """Import vLLM's released offloading tier layer (``vllm.v1.kv_offload``: the secondary
    tier interface, its async lookup manager, the tier factory, the ``fs`` tier and its file
    mapper) from the wheel, as they are. Skipped: the ``__init__`` of ``vllm`` and of the
    ``vllm.distributed`` packages (the GPU and distributed stack). From
    ``parallel_state`` (the distributed stack), the logger's rank checks
    (``is_global_first_rank``, ``is_local_first_rank``) are taken by name. ``canonical_mapping``
    imports the CUDA-side KV cache interface; the one released function the file mapper uses
    from it (``canonical_format_id``) is taken from the wheel's source by name, with the
    released ``KVCacheLayout`` it reads."""
    with _vllm_lock:
        deps = unpack(wheel("msgspec", MSGSPEC_VERSION), ["msgspec/"])
        if str(deps) not in sys.path:
            sys.path.insert(0, str(deps))
        root = unpack(wheel("vllm", version), VLLM_FILES)
        pkg = root / "vllm"
        if getattr(sys.modules.get("vllm"), "__path__", [None])[0] != str(pkg):
            for name in _VLLM_BARE:
                _package(name, root.joinpath(*name.split(".")))
            import importlib
            layout = importlib.import_module("vllm.v1.kv_cache_layout")
            cm = types.ModuleType(_OFFLOADING.replace("/", ".") + ".canonical_mapping")
            cm.__dict__.update(KVCacheLayout=layout.KVCacheLayout)
            exec(_constant(root / f"{_OFFLOADING}/canonical_mapping.py", "CANONICAL_FORMAT_VERSION"), cm.__dict__)
            released_defs(root / f"{_OFFLOADING}/canonical_mapping.py", ["canonical_format_id"], cm.__dict__)
            sys.modules[cm.__name__] = cm
            # the logger's once-per-rank check (single process: no world group)
            ps = types.ModuleType("vllm.distributed.parallel_state")
            ps.__dict__.update(torch=torch, envs=importlib.import_module("vllm.envs"), _WORLD=None)
            released_defs(root / "vllm/distributed/parallel_state.py", ["is_global_first_rank", "is_local_first_rank"],
                          ps.__dict__)
            sys.modules[ps.__name__] = ps
        import importlib
        mods = dict(base="vllm.v1.kv_offload.base", config="vllm.v1.kv_offload.config",
                    file_mapper="vllm.v1.kv_offload.file_mapper", tiering="vllm.v1.kv_offload.tiering.base",
                    tier_factory="vllm.v1.kv_offload.tiering.factory", fs="vllm.v1.kv_offload.tiering.fs.manager",
                    spec_factory="vllm.v1.kv_offload.factory")
        mods = {k: importlib.import_module(m) for k, m in mods.items()}
        return types.SimpleNamespace(root=root, pkg=pkg, version=version, **mods)


def _constant(path: Path, name: str) -> str:
    """The released module-level assignment ``name = ...`` of ``path``, as source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.unparse(node)
    raise RuntimeError(f"{path}: no {name}")


# -- LMCache ----------------------------------------------------------------------------
LMCACHE_VERSION = "0.5.6"
AIOFILES_VERSION = "25.1.0"       # the fs L2 adapter's async file I/O
_L2 = "lmcache/v1/distributed/l2_adapters"
LMCACHE_FILES = [
    "lmcache/__init__.py", "lmcache/logging.py", "lmcache/_version.py", "lmcache/v1/__init__.py",
    "lmcache/lmcache_native.cpython-311-x86_64-linux-gnu.so", "lmcache/v1/platform/", "lmcache/v1/utils/",
    "lmcache/v1/mp_observability/", "lmcache/v1/multiprocess/__init__.py", "lmcache/v1/multiprocess/transfer_mode.py",
    "lmcache/v1/distributed/api.py", "lmcache/v1/distributed/internal_api.py", "lmcache/v1/distributed/serde/",
    "lmcache/v1/memory_management.py", f"{_L2}/",
    # read (not imported) by the recipe test: the server command and its storage arguments
    "lmcache/v1/distributed/config.py", "lmcache/cli/commands/server.py",
]
_lmcache_lock = threading.Lock()


def load_lmcache(version: str = LMCACHE_VERSION) -> types.SimpleNamespace:
    """Import LMCache's released L2 adapter layer: the adapter interface (``base``), its
    config registry and factory, the ``plugin`` adapter (the plugin mechanism) and the ``fs``
    adapter, with LMCache's native ``Bitmap`` (the wheel's ``lmcache_native`` extension) and
    event notifiers, as they are. Three modules import LMCache's L1 memory manager
    (``memory_management``: numba device ops, CUDA allocators); from them the released
    definitions the L2 layer uses are taken by name: ``L2StoreResult``, ``L1MemoryDesc`` and
    ``L2AdapterListener`` (``internal_api``), ``MemoryObj`` (``memory_management``: the
    interface only; an L1 object here is :class:`L1Object`) and ``SerdeConfig`` (``serde``).
    The ``l2_adapters`` package ``__init__`` (which imports ``internal_api``) is skipped."""
    with _lmcache_lock:
        for dep, ver, top in (("aiofiles", AIOFILES_VERSION, "aiofiles/"), ("msgspec", MSGSPEC_VERSION, "msgspec/")):
            d = unpack(wheel(dep, ver), [top])
            if str(d) not in sys.path:
                sys.path.insert(0, str(d))
        root = unpack(wheel("lmcache", version), LMCACHE_FILES)
        pkg = root / "lmcache"
        import importlib
        if getattr(sys.modules.get("lmcache"), "__path__", [None])[0] != str(pkg):
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            importlib.import_module("lmcache")
            dist = pkg / "v1" / "distributed"
            mm = sys.modules["lmcache.v1.memory_management"] = types.ModuleType("lmcache.v1.memory_management")
            exec("import abc, torch\nfrom typing import Any, List, Optional, Tuple, Union", mm.__dict__)
            released_defs(pkg / "v1" / "memory_management.py", ["MemoryObj"], mm.__dict__)
            api = importlib.import_module("lmcache.v1.distributed.api")
            ia = sys.modules["lmcache.v1.distributed.internal_api"] = types.ModuleType(
                "lmcache.v1.distributed.internal_api")
            exec("import enum\nfrom abc import ABC, abstractmethod\nfrom dataclasses import dataclass, field",
                 ia.__dict__)
            ia.__dict__.update(ObjectKey=api.ObjectKey, MemoryLayoutDesc=api.MemoryLayoutDesc)
            released_defs(dist / "internal_api.py", ["L1MemoryDesc", "EventListener", "L2AdapterListener",
                                                     "L2StoreResult"], ia.__dict__)
            _package("lmcache.v1.distributed.serde", dist / "serde")
            serde = sys.modules["lmcache.v1.distributed.serde"]
            serde.SerdeConfig = importlib.import_module("lmcache.v1.distributed.serde.base").SerdeConfig
            _package("lmcache.v1.distributed.l2_adapters", dist / "l2_adapters")
        mods = dict(native="lmcache.lmcache_native", api="lmcache.v1.distributed.api",
                    internal_api="lmcache.v1.distributed.internal_api", base="lmcache.v1.distributed.l2_adapters.base",
                    config="lmcache.v1.distributed.l2_adapters.config",
                    factory="lmcache.v1.distributed.l2_adapters.factory",
                    plugin="lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
                    fs="lmcache.v1.distributed.l2_adapters.fs_l2_adapter",
                    notifier="lmcache.v1.platform")
        mods = {k: importlib.import_module(m) for k, m in mods.items()}
        return types.SimpleNamespace(root=root, pkg=pkg, version=version, **mods)


class L1Object:
    """An L1 memory object as the L2 adapters use it: ``byte_array`` is a writable view of
    the object's bytes in the L1 arena (what the released ``TensorMemoryObj.byte_array``
    returns), ``get_size()`` its size."""

    def __init__(self, arena: torch.Tensor, offset: int, size: int):
        self.raw_data = arena[offset:offset + size]
        self._size = size

    def get_size(self) -> int:
        return self._size

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw_data.numpy())
