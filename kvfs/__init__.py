"""kvfs: a tiered KV-cache filesystem for LLM inference.

The filesystem and store import nothing heavy; ``kvfs.KVCache`` and
``kvfs.KVLayout`` load the KV layer (and torch) on first use.
"""
__version__ = "0.1.0"

__all__ = ["KVCache", "KVLayout", "weights_fingerprint", "__version__"]


def __getattr__(name):
    if name in ("KVCache", "KVLayout", "weights_fingerprint"):
        from kvfs import kv
        return getattr(kv, name)
    raise AttributeError(f"module 'kvfs' has no attribute {name!r}")
