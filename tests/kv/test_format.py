"""The block header format and the pure-Python modules the daemon imports."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save as st_save

from kvfs.kv.block import check_header, encode_header
from kvfs.blockformat import (FORMAT, HEADER_READ, BlockFormatError, build_header, header_length,
                            parse_block_header)
from kvfs.kv.layout import KVLayout, block_path, ensure_namespace, namespace_name

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=4)


def _block(parent="", tokens=4, h="ab" * 16, token_ids=(1, 2, 3, 4)):
    payload = np.arange(LAYOUT.block_bytes // 4, dtype=np.float32)
    header = encode_header(LAYOUT, namespace="m__0123", hash_hex=h, parent_hex=parent, tokens=tokens,
                           hash_algo="sha256_cbor", payload=payload, token_ids=list(token_ids))
    return header, payload


def test_block_is_safetensors_with_aligned_payload(tmp_path):
    header, payload = _block()
    assert len(header) % 4096 == 0 and header_length(header) == len(header)
    path = tmp_path / "x.kv"
    path.write_bytes(header + payload.tobytes())
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        t = f.get_tensor("kv")
    assert meta["format"] == FORMAT and meta["kvfs.hash"] == "ab" * 16 and meta["kvfs.token_ids"] == "1,2,3,4"
    assert t.shape == LAYOUT.block_shape() and np.array_equal(t.reshape(-1), payload)
    assert len(meta["kvfs.checksums"].split(",")) == LAYOUT.num_layers


def test_parse_block_header_fields():
    header, _ = _block(parent="cd" * 16, tokens=8)
    p = parse_block_header(header[:HEADER_READ])
    assert p["hash"] == "ab" * 16 and p["parent"] == "cd" * 16
    assert p["tokens"] == 8 and p["block_tokens"] == 4 and p["namespace"] == "m__0123"
    assert p["data_offset"] == 4096 and p["tensors"]["kv"]["shape"] == list(LAYOUT.block_shape())


def test_parse_block_header_rejects_non_blocks():
    assert parse_block_header(b"") is None
    assert parse_block_header(b"\x00" * 4096) is None
    assert parse_block_header(b"hello world, this is not safetensors" * 200) is None
    plain = st_save({"x": np.zeros(4, np.float32)}, metadata={"format": "pt"})
    assert parse_block_header(plain) is None
    header, _ = _block()
    assert parse_block_header(header[:100]) is None          # truncated JSON
    # a kvfs-looking header with bad fields is not a block
    for bad in ({"kvfs.tokens": "x"}, {"kvfs.hash": "XYZ"}, {"kvfs.parent": "ab" * 16},
                {"kvfs.tokens": "6"}, {"kvfs.namespace": None}):
        meta = {"format": FORMAT, "kvfs.namespace": "n", "kvfs.hash": "ab" * 16, "kvfs.parent": "",
                "kvfs.tokens": "4", "kvfs.block_tokens": "4"}
        meta.update(bad)
        raw = json.dumps({"__metadata__": meta}).encode()
        assert parse_block_header(struct.pack("<Q", len(raw)) + raw) is None, bad


def test_check_header_catches_wrong_block_and_layout():
    header, _ = _block()
    info = check_header(header, path="p", expect_hash="ab" * 16, layout=LAYOUT, expect_tokens=4)
    assert info.data_offset == 4096
    with pytest.raises(BlockFormatError, match="expected"):
        check_header(header, path="p", expect_hash="cd" * 16, layout=LAYOUT)
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=4)
    with pytest.raises(BlockFormatError, match="layout"):
        check_header(header, path="p", expect_hash="ab" * 16, layout=other)


def test_build_header_validates():
    with pytest.raises(BlockFormatError, match="str to str"):
        build_header({"a": 1}, {})
    with pytest.raises(BlockFormatError, match="bytes"):
        build_header({}, {"kv": ("F32", [2, 2], 15)})
    with pytest.raises(BlockFormatError, match="does not fit"):
        build_header({"x": "y" * 5000}, {}, max_bytes=4096)


def test_block_path_and_namespace(tmp_path):
    h = "0f" * 32
    assert block_path("/m/ns", h) == f"/m/ns/0f/{h}.kv"
    for bad in ("", "0F" * 16, "xyz", "ab", None, "ab/cd" * 4):
        with pytest.raises(ValueError, match="hex"):
            block_path("/m/ns", bad)
    a = namespace_name("meta-llama/Llama-3.1-8B", LAYOUT, "sha256_cbor")
    assert a.startswith("meta-llama--Llama-3.1-8B__") and "/" not in a
    assert a != namespace_name("meta-llama/Llama-3.1-8B", LAYOUT, "xxhash_cbor")
    rank1 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=4,
                     tp_rank=1, tp_size=2)
    assert a != namespace_name("meta-llama/Llama-3.1-8B", rank1, "sha256_cbor")
    ns = ensure_namespace(str(tmp_path), "m", LAYOUT, "sha256_cbor")
    assert ensure_namespace(str(tmp_path), "m", LAYOUT, "sha256_cbor") == ns
    desc = json.loads((Path(ns) / "namespace.json").read_text())
    assert desc["layout"]["dtype"] == "float32" and desc["model"] == "m"
    (Path(ns) / "namespace.json").write_text(json.dumps(dict(desc, model="other")))
    with pytest.raises(ValueError, match="different cache"):
        ensure_namespace(str(tmp_path), "m", LAYOUT, "sha256_cbor")
    with pytest.raises(FileNotFoundError):
        ensure_namespace(str(tmp_path / "missing"), "m", LAYOUT, "sha256_cbor")


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, dtype="complex64")
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout(0, 1, 1)
    with pytest.raises(ValueError, match="tp_rank"):
        KVLayout(1, 1, 1, tp_rank=2, tp_size=2)
    assert KVLayout(1, 1, 1, dtype="bf16").dtype == "bfloat16"


def test_daemon_side_modules_do_not_import_torch():
    code = ("import sys, kvfs, kvfs.blockformat, kvfs.kv.layout, kvfs.kv.tree, kvfs.kv.hashing, kvfs.kv.blockio\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from kvfs.blockformat import parse_block_header; from kvfs.kv.layout import block_path\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
