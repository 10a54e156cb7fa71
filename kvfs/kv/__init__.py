"""The KV layer: prefix hashing, the KVCache API and the loader (the block file format is
``kvfs.blockformat``, shared with the daemon, which sniffs block headers at seal).

``kvfs.blockformat`` and ``kvfs.kv.layout`` are pure Python;
``KVCache`` (and with it torch) loads on first attribute access.
"""
from kvfs.kv.layout import KVLayout

__all__ = ["KVCache", "KVLayout", "weights_fingerprint"]


def __getattr__(name):
    if name == "KVCache":
        from kvfs.kv.cache import KVCache
        return KVCache
    if name == "weights_fingerprint":
        from kvfs.kv.identity import weights_fingerprint
        return weights_fingerprint
    raise AttributeError(f"module 'kvfs.kv' has no attribute {name!r}")
