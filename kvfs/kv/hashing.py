"""Prefix hashing: one hash per block of B tokens, chained through the parent's hash.

``hash_i = H(cbor([parent_hash_or_null, [token ids of block i], extra_keys_or_null]))``

- ``H`` is SHA-256 (``"sha256_cbor"``, the default, 32 bytes) or xxh3-128
  (``"xxhash_cbor"``, 16 bytes, faster, not collision resistant against an adversary).
- The CBOR encoding is canonical (RFC 8949 deterministic encoding), so hashes agree across
  processes, machines and Python versions; nothing depends on ``PYTHONHASHSEED``.
- ``extra_keys`` is a list of ``[kind, value, ...]`` lists, in this order:
  ``["lora", name]`` on every block when a LoRA adapter is active;
  ``["mm", identifier, offset]`` for every multimodal input whose placeholder tokens
  ``[offset, offset + length)`` overlap the block; ``["salt", cache_salt]`` on the first
  block only, so tenants with different salts share no block at all.
- The first block's parent is CBOR ``null``. Only whole blocks are hashed.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import logging
import sys
from collections.abc import Iterable, Sequence

import cbor2
import xxhash

log = logging.getLogger(__name__)

ALGORITHMS = ("sha256_cbor", "xxhash_cbor")
_ALIASES = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor", "xxh3_128": "xxhash_cbor"}
_MAX_TOKEN = 2**63 - 1


def canonical_algo(name: str) -> str:
    algo = _ALIASES.get(name, name)
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of {ALGORITHMS}")
    return algo


def _digest(algo: str, data: bytes) -> bytes:
    if algo == "sha256_cbor":
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


@dataclasses.dataclass(frozen=True)
class MMInput:
    """A multimodal input: ``identifier`` (e.g. a content hash of the image) occupies the
    placeholder tokens ``[offset, offset + length)`` of the prompt."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self):
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"MMInput.identifier must be a non-empty str, got {self.identifier!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"MMInput.offset must be an int >= 0, got {self.offset!r}")
        if not isinstance(self.length, int) or self.length <= 0:
            raise ValueError(f"MMInput.length must be an int > 0, got {self.length!r}")


_SIGN_BYTES = slice(7, None, 8) if sys.byteorder == "little" else slice(0, None, 8)


def token_array(token_ids) -> array.array:
    """Token ids (list, tuple, range, numpy array, 1-D torch tensor) as a validated
    ``array('q')``: ints in ``[0, 2**63)``; bools and ``__index__`` types become ints."""
    if isinstance(token_ids, array.array) and token_ids.typecode == "q":
        packed = token_ids
    else:
        if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple, array.array)):
            if getattr(token_ids, "ndim", 1) != 1:
                raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        if not isinstance(token_ids, (list, tuple, array.array)):
            token_ids = list(token_ids)
        try:                                    # the common case, checked in C
            packed = array.array("q", token_ids)
        except (TypeError, OverflowError):
            packed = array.array("q", _checked_slow(token_ids))
    # a negative int64 has its sign bit set: every sign byte below 0x80 means all >= 0
    if not packed.tobytes()[_SIGN_BYTES].isascii():
        raise ValueError(f"token id {min(packed)} out of range [0, 2**63)")
    return packed


def _checked_slow(token_ids) -> list[int]:
    out = []
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool):
            try:
                import operator
                t = operator.index(t)
            except TypeError:
                raise TypeError(f"token id {t!r} is not an int") from None
        if not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"token id {t} out of range [0, 2**63)")
        out.append(int(t))
    return out


def as_token_list(token_ids) -> list[int]:
    """Token ids from a list, tuple, range, numpy array or 1-D torch tensor, validated."""
    return token_array(token_ids).tolist()


def block_extra_keys(block_index: int, block_tokens: int, *, cache_salt: str | None = None,
                     lora_name: str | None = None, mm_inputs: Sequence[MMInput] = ()) -> list | None:
    """The extra keys of block ``block_index`` (see the module docstring)."""
    keys: list = []
    if lora_name is not None:
        keys.append(["lora", str(lora_name)])
    start, end = block_index * block_tokens, (block_index + 1) * block_tokens
    for mm in mm_inputs:
        if mm.offset < end and mm.offset + mm.length > start:
            keys.append(["mm", mm.identifier, mm.offset])
    if block_index == 0 and cache_salt is not None:
        keys.append(["salt", str(cache_salt)])
    return keys or None


def hash_block(algo: str, parent: bytes | None, tokens: Sequence[int], extra_keys: list | None) -> bytes:
    """Hash one block given its parent's hash (None for the first block)."""
    payload = cbor2.dumps([parent, list(tokens), extra_keys], canonical=True)
    return _digest(algo, payload)


class PrefixHasher:
    """Hashes token prefixes block by block for one namespace's hashing parameters."""

    def __init__(self, block_tokens: int, algo: str = "sha256_cbor", *, cache_salt: str | None = None,
                 lora_name: str | None = None, memo_size: int = 65536):
        if not isinstance(block_tokens, int) or block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        self.block_tokens = block_tokens
        self.algo = canonical_algo(algo)
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # (parent, block tokens) -> hash, for chains without multimodal inputs: prompts that
        # share a prefix (and lookup/save/load of one prompt) hash it once
        self._memo: collections.OrderedDict = collections.OrderedDict()
        self.memo_size = memo_size

    def hashes(self, token_ids, *, mm_inputs: Sequence[MMInput] = (), start: int = 0,
               parent: bytes | None = None) -> list[bytes]:
        """Hashes of every whole block of ``token_ids``. A trailing partial block is ignored.

        ``start``/``parent`` continue a chain: hash blocks from block ``start`` on, given the
        hash of block ``start - 1`` (faster for a prompt that extends a known one).
        """
        tokens = token_array(token_ids)
        mm = tuple(mm_inputs)
        for m in mm:
            if not isinstance(m, MMInput):
                raise TypeError(f"mm_inputs must hold MMInput objects, got {type(m).__name__}")
        if start and parent is None:
            raise ValueError("continuing a chain from start > 0 needs the parent hash")
        b = self.block_tokens
        out: list[bytes] = []
        memo = self._memo if not mm and self.memo_size else None
        for i in range(start, len(tokens) // b):
            block = tokens[i * b:(i + 1) * b]
            if memo is not None:
                key = (parent, block.tobytes())
                h = memo.get(key)
                if h is not None:
                    memo.move_to_end(key)
                    parent = h
                    out.append(h)
                    continue
            extra = block_extra_keys(i, b, cache_salt=self.cache_salt, lora_name=self.lora_name, mm_inputs=mm)
            parent = hash_block(self.algo, parent, block, extra)
            out.append(parent)
            if memo is not None:
                memo[key] = parent
                if len(memo) > self.memo_size:
                    memo.popitem(last=False)
        return out

    def hex_hashes(self, token_ids, **kw) -> list[str]:
        return [h.hex() for h in self.hashes(token_ids, **kw)]
