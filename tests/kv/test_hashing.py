"""Prefix hashing: checked-in vectors, a second process, isolation by salt/LoRA/multimodal."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvfs.kv.hashing import MMInput, PrefixHasher, as_token_list, canonical_algo

VECTORS = Path(__file__).with_name("hash_vectors.json")
REPO = Path(__file__).resolve().parents[2]


def _compute(case: dict) -> list[str]:
    h = PrefixHasher(case["block_tokens"], case["algo"], cache_salt=case["cache_salt"],
                     lora_name=case["lora_name"])
    mm = tuple(MMInput(*m) for m in case["mm_inputs"])
    return h.hex_hashes(case["tokens"], mm_inputs=mm)


def test_vectors_in_this_process():
    cases = json.loads(VECTORS.read_text())["cases"]
    assert len(cases) >= 7
    for case in cases:
        assert _compute(case) == case["hashes"], case["name"]


@pytest.mark.parametrize("seed", ["0", "12345", "random"])
def test_vectors_in_another_process_with_another_hash_seed(seed):
    code = (
        "import json, sys\n"
        "from tests.kv.test_hashing import _compute\n"
        f"cases = json.load(open({str(VECTORS)!r}))['cases']\n"
        "print(json.dumps([_compute(c) for c in cases]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cases = json.loads(VECTORS.read_text())["cases"]
    assert json.loads(out.stdout) == [c["hashes"] for c in cases]


def test_encoding_is_canonical_cbor_written_out_by_hand():
    # first block: cbor([null, [1, 2, 3, 4], null]) = 83 f6 84 01 02 03 04 f6
    first = hashlib.sha256(bytes.fromhex("83f68401020304f6")).digest()
    # second block: cbor([bstr(32) first, [5, 6, 7, 8], null])
    second = hashlib.sha256(bytes.fromhex("835820") + first + bytes.fromhex("8405060708f6")).digest()
    assert PrefixHasher(4, "sha256_cbor").hashes([1, 2, 3, 4, 5, 6, 7, 8]) == [first, second]
    x = xxhash.xxh3_128_digest(bytes.fromhex("83f68401020304f6"))
    assert PrefixHasher(4, "xxhash_cbor").hashes([1, 2, 3, 4]) == [x]


def test_salt_only_on_first_block_but_changes_every_hash():
    toks = list(range(64))
    plain = PrefixHasher(16).hex_hashes(toks)
    a = PrefixHasher(16, cache_salt="tenant-a").hex_hashes(toks)
    b = PrefixHasher(16, cache_salt="tenant-b").hex_hashes(toks)
    assert len(plain) == len(a) == len(b) == 4
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert PrefixHasher(16, cache_salt="tenant-a").hex_hashes(toks) == a


def test_lora_and_multimodal_keys_separate_blocks():
    toks = [9] * 48
    base = PrefixHasher(16).hex_hashes(toks)
    lora = PrefixHasher(16, lora_name="adapter").hex_hashes(toks)
    assert all(x != y for x, y in zip(base, lora))
    mm = PrefixHasher(16).hex_hashes(toks, mm_inputs=(MMInput("img-1", 20, 8),))
    other = PrefixHasher(16).hex_hashes(toks, mm_inputs=(MMInput("img-2", 20, 8),))
    # block 0 does not overlap tokens 20..27: unchanged; block 1 does, and so every later block
    assert mm[0] == base[0] == other[0]
    assert mm[1] != base[1] and mm[1] != other[1] and mm[2] != other[2]


def test_prefix_property_and_partial_block_ignored():
    h = PrefixHasher(16)
    long = h.hex_hashes(list(range(100)))
    assert len(long) == 6
    assert h.hex_hashes(list(range(50))) == long[:3]
    assert h.hex_hashes(list(range(15))) == []
    # continuing a chain from a known parent gives the same hashes
    raw = h.hashes(list(range(100)))
    assert h.hashes(list(range(100)), start=3, parent=raw[2]) == raw[3:]


def test_token_containers_agree():
    np = pytest.importorskip("numpy")
    toks = list(range(32))
    h = PrefixHasher(16)
    assert h.hashes(np.arange(32, dtype=np.int64)) == h.hashes(toks) == h.hashes(tuple(toks)) == h.hashes(range(32))


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        canonical_algo("md5")
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixHasher(0)
    with pytest.raises(TypeError, match="not an int"):
        as_token_list([1, 2.5])
    with pytest.raises(ValueError, match="out of range"):
        as_token_list([-1])
    with pytest.raises(TypeError, match="sequence of ints"):
        as_token_list("hello")
    with pytest.raises(TypeError, match="cache_salt"):
        PrefixHasher(16, cache_salt=b"bytes")
    with pytest.raises(ValueError, match="parent"):
        PrefixHasher(16).hashes(list(range(64)), start=2)
    with pytest.raises(ValueError, match="offset"):
        MMInput("x", -1, 3)


def test_memo_gives_the_same_hashes_as_fresh_hashing():
    toks = list(range(200))
    warm = PrefixHasher(16, cache_salt="s")
    first = warm.hashes(toks)
    assert warm.hashes(toks) == first == PrefixHasher(16, cache_salt="s", memo_size=0).hashes(toks)
    tiny = PrefixHasher(16, memo_size=3)
    assert tiny.hashes(toks) == PrefixHasher(16).hashes(toks) and len(tiny._memo) == 3
    # a block's memo entry is keyed by its parent: the same tokens after another prefix differ
    a = warm.hashes([1] * 16 + [2] * 16)
    b = warm.hashes([3] * 16 + [2] * 16)
    assert a[1] != b[1]
