"""The on-mount layout: namespace directories per model and KV layout, blocks sharded by hash.

::

    <root>/<namespace>/namespace.json         what the namespace holds (model, layout, hash algo)
    <root>/<namespace>/<h[:2]>/<h>.kv         one block file per prefix hash ``h``

``<namespace>`` is ``<model with / as -->__<layout digest, 16 hex>``: the digest covers the
model id, every layout field, the tensor-parallel rank/size, the hash algorithm, the block
format and, when the caller gives them, the weights' revision and fingerprint, so caches that are not interchangeable never share a directory. 256 shard
directories keep a million blocks at ~4k entries per directory.

Pure Python (no torch): the daemon imports :func:`block_path`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re

from kvfs.blockformat import FORMAT
from kvfs.kv.lookup import find_control, makedirs_under, open_mount_root, replace_at

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kv"
NAMESPACE_FILE = "namespace.json"
_HEX = re.compile(r"^[0-9a-f]{8,128}$")
_MODEL_SAFE = re.compile(r"[^A-Za-z0-9._-]+")

# torch dtype name -> (safetensors dtype code, element size)
DTYPES = {
    "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2), "float64": ("F64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "int8": ("I8", 1), "uint8": ("U8", 1),
}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp8": "float8_e4m3fn", "double": "float64"}


def block_path(namespace_dir: str, hash_hex: str) -> str:
    """Path of the block file for ``hash_hex`` (lowercase hex) inside ``namespace_dir``."""
    if not isinstance(hash_hex, str) or not _HEX.match(hash_hex):
        raise ValueError(f"block hash must be 8-128 lowercase hex digits, got {hash_hex!r}")
    return os.path.join(namespace_dir, hash_hex[:2], hash_hex + BLOCK_SUFFIX)


def block_relpath(hash_hex: str) -> str:
    """``<h[:2]>/<h>.kv``: the block's path relative to its namespace directory."""
    return block_path("", hash_hex)


def dtype_name(dtype) -> str:
    """Normalise a torch dtype (or its name) to the name torch uses, e.g. ``"bfloat16"``."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model on one tensor-parallel rank.

    A block's tensor is ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]`` (2 = K, V).
    ``dtype`` may be a torch dtype or its name; it is stored as the name.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: object = "bfloat16"
    block_tokens: int = 16
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be in [0, tp_size), got {self.tp_rank!r}")

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def st_dtype(self) -> str:
        """The safetensors dtype code (``BF16``, ``F32``, ...)."""
        return DTYPES[self.dtype][0]

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def block_shape(self, tokens: int | None = None) -> tuple[int, ...]:
        t = self.block_tokens if tokens is None else tokens
        return (self.num_layers, 2, t, self.num_kv_heads, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block."""
        return 2 * self.block_tokens * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block."""
        return self.num_layers * self.layer_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


def _identity_field(name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
    return value


def namespace_descriptor(model: str, layout: KVLayout, hash_algo: str, *,
                         revision: str | None = None, weights: str | None = None) -> dict:
    """What ``namespace.json`` records; everything that makes two caches incompatible.

    ``revision`` (the caller's name for the weights' version) and ``weights`` (a fingerprint of
    the weights' bytes, :func:`kvfs.kv.identity.weights_fingerprint`) are recorded only when
    given, so a namespace made without them keeps its name and its ``namespace.json``."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    desc = {"format": FORMAT, "model": model, "layout": layout.to_dict(), "hash_algo": hash_algo}
    revision = _identity_field("revision", revision)
    weights = _identity_field("weights", weights)
    if revision is not None:
        desc["revision"] = revision
    if weights is not None:
        desc["weights"] = weights
    return desc


def namespace_name(model: str, layout: KVLayout, hash_algo: str, *,
                   revision: str | None = None, weights: str | None = None) -> str:
    """Directory name of the namespace for this model, layout, hash algorithm and (when given)
    weights' revision and fingerprint."""
    desc = namespace_descriptor(model, layout, hash_algo, revision=revision, weights=weights)
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    safe = _MODEL_SAFE.sub("-", model.replace("/", "--")).strip("-.")[:80] or "model"
    return f"{safe}__{digest}"


def ensure_namespace(root: str, model: str, layout: KVLayout, hash_algo: str, *,
                     revision: str | None = None, weights: str | None = None) -> str:
    """Create (or verify) the namespace directory under ``root``; return its path."""
    return open_namespace(root, model, layout, hash_algo, revision=revision, weights=weights)[0]


def open_namespace(root: str, model: str, layout: KVLayout, hash_algo: str, *,
                   revision: str | None = None, weights: str | None = None) -> tuple[str, int | None]:
    """Create (or verify) the namespace directory under ``root``: ``(path, dev)``. Inside a
    kvfs mount the directory is made through the mount's root (a mount that dies meanwhile
    fails instead of the directory landing under the bare mount point) and ``dev`` is the
    mount's st_dev; elsewhere ``dev`` is None."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"KV cache root {root!r} is not a directory")
    name = namespace_name(model, layout, hash_algo, revision=revision, weights=weights)
    ns_dir = os.path.join(root, name)
    ctl = find_control(root)
    dev = makedirs_under(ctl[0] if ctl is not None else None, ns_dir)
    meta_path = os.path.join(ns_dir, NAMESPACE_FILE)
    desc = dict(namespace_descriptor(model, layout, hash_algo, revision=revision, weights=weights),
                namespace=name)
    # on a mount: read and write namespace.json through a descriptor of its root (a mount
    # that died since the directory was made fails, ENOTCONN, instead of the file landing
    # under the bare mount point)
    at = open_mount_root(ctl[0]) if ctl is not None else None
    meta = os.path.relpath(os.path.realpath(meta_path), ctl[0]) if ctl is not None else meta_path
    try:
        try:
            fd = os.open(meta, os.O_RDONLY | os.O_CLOEXEC, dir_fd=at)
            with open(fd, "rb") as f:
                existing = json.loads(f.read())
        except FileNotFoundError:
            existing = None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{meta_path}: unreadable namespace metadata: {e}") from None
        if existing is None:
            text = json.dumps(desc, indent=2, sort_keys=True) + "\n"
            replace_at(at, f"{meta}.{os.getpid()}.{os.urandom(4).hex()}.tmp",
                       meta, text.encode())
            log.info("created KV namespace %s", ns_dir)
        elif existing != desc:
            raise ValueError(f"{meta_path} describes a different cache: {existing} != {desc}")
    finally:
        if at is not None:
            os.close(at)
    return ns_dir, (dev if ctl is not None else None)
