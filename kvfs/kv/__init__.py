"""The KV layer: prefix hashing, the block file format, the KVCache API and the loader.

``kvfs.kv.format`` and ``kvfs.kv.layout`` are pure Python (the daemon imports them);
``KVCache`` (and with it torch) loads on first attribute access.
"""
from kvfs.kv.layout import KVLayout

__all__ = ["KVCache", "KVLayout"]


def __getattr__(name):
    if name == "KVCache":
        from kvfs.kv.cache import KVCache
        return KVCache
    raise AttributeError(f"module 'kvfs.kv' has no attribute {name!r}")
