"""The weights' identity in the namespace: other weights, another dtype or TP size is a miss,
never a hit; namespaces made without an identity stay where they were."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import kvfs  # noqa: E402
from kvfs.kv.hf import PrefixCachedLM, layout_for, random_llama  # noqa: E402
from kvfs.kv.identity import weights_fingerprint  # noqa: E402
from kvfs.kv.layout import KVLayout, namespace_name  # noqa: E402

pytestmark = pytest.mark.torch

MODEL = "test/tiny-llama"
PROMPT = list(range(3, 3 + 40))             # 5 blocks of 8 tokens


def _model(seed=0):
    return random_llama(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, seed=seed)


def _save(root, model, **kw):
    """Prefill PROMPT with ``model`` and save its KV; returns the cache's namespace."""
    with kvfs.KVCache(root, MODEL, layout_for(model.config, block_tokens=8), **kw) as cache:
        PrefixCachedLM(model, cache).prefill(PROMPT)
        cache.flush()
        assert cache.lookup(PROMPT) == 40
        return cache.namespace


def _cached(root, layout, **kw) -> int:
    with kvfs.KVCache(root, MODEL, layout, **kw) as cache:
        return cache.lookup(PROMPT)


def test_namespace_without_identity_keeps_its_name():
    # pinned before revision/weights existed: such namespaces stay readable by callers passing none
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)
    assert namespace_name("test/model", lay, "sha256_cbor") == "test--model__c24a4da6add76541"
    names = {namespace_name("test/model", lay, "sha256_cbor", revision=r, weights=w)
             for r in (None, "a", "b") for w in (None, "xxh3-128:00", "xxh3-128:01")}
    assert len(names) == 9
    for bad in ("", " ", 3, "a\0b"):
        with pytest.raises(ValueError, match="revision"):
            namespace_name("test/model", lay, "sha256_cbor", revision=bad)


def test_fingerprint_covers_every_byte_dtype_and_name():
    model = _model()
    fp = weights_fingerprint(model)
    assert fp.startswith("xxh3-128:") and len(fp) == len("xxh3-128:") + 32
    assert weights_fingerprint(model) == fp
    assert weights_fingerprint(_model()) == fp                  # same weights, another object
    assert weights_fingerprint(_model(seed=1)) != fp
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert weights_fingerprint(sd) == fp                        # a state dict works alike
    name = "model.layers.1.mlp.down_proj.weight"
    w = sd[name].view(-1)
    w[7] = torch.nextafter(w[7], torch.tensor(float("inf")))    # one ulp in one element
    assert weights_fingerprint(sd) != fp
    sd[name] = model.state_dict()[name]
    assert weights_fingerprint(sd) == fp
    assert weights_fingerprint({k: v.to(torch.bfloat16) for k, v in sd.items()}) != fp
    renamed = dict(sd)
    renamed["x." + name] = renamed.pop(name)
    assert weights_fingerprint(renamed) != fp
    with pytest.raises(ValueError, match="meta"):
        weights_fingerprint({"w": torch.empty(3, device="meta")})


def test_fingerprint_hashes_tied_weights_once_and_is_stable_across_processes():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tied = {"emb": a, "head": a}
    untied = {"emb": a, "head": a.clone()}
    assert weights_fingerprint(tied) != weights_fingerprint(untied)      # the alias is recorded
    code = ("import torch; from kvfs.kv.identity import weights_fingerprint as f; "
            "print(f({'w': torch.arange(12, dtype=torch.float32).reshape(3, 4), 'b': torch.ones(2)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}).stdout.strip()
    assert out == weights_fingerprint({"b": torch.ones(2), "w": a})


def test_changed_weight_dtype_or_tp_size_is_a_miss(tmp_path):
    model = _model()
    layout = layout_for(model.config, block_tokens=8)
    fp = weights_fingerprint(model)
    ns = _save(tmp_path, model, revision="r1", weights=model)      # the model: fingerprinted by KVCache
    assert _cached(tmp_path, layout, revision="r1", weights=fp) == 40
    meta = json.loads((tmp_path / ns / "namespace.json").read_text())
    assert (meta["revision"], meta["weights"]) == ("r1", fp)

    # one weight changed by one ulp: other weights, another namespace, nothing cached
    with torch.no_grad():
        p = model.model.layers[0].self_attn.k_proj.weight
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))
    assert _cached(tmp_path, layout, revision="r1", weights=model) == 0
    assert _cached(tmp_path, layout, revision="r2", weights=fp) == 0     # another revision
    assert _cached(tmp_path, layout, weights=fp) == 0                   # revision missing
    assert _cached(tmp_path, layout, revision="r1") == 0                # fingerprint missing
    assert _cached(tmp_path, layout) == 0           # a caller with no identity: not these blocks

    # another KV dtype (the model cast to bfloat16): another layout and other weights
    half = _model().to(torch.bfloat16)
    half_layout = dataclasses.replace(layout, dtype="bfloat16")
    assert _cached(tmp_path, half_layout, revision="r1", weights=half) == 0
    assert _cached(tmp_path, half_layout, revision="r1", weights=fp) == 0

    # the same weights at another tensor-parallel size (or rank)
    for tp_rank, tp_size in ((0, 2), (1, 2)):
        tp = dataclasses.replace(layout, tp_rank=tp_rank, tp_size=tp_size)
        assert _cached(tmp_path, tp, revision="r1", weights=fp) == 0
    assert _cached(tmp_path, layout, revision="r1", weights=_model()) == 40   # the original weights again


def test_namespace_made_without_identity_stays_readable(tmp_path):
    model = _model()
    layout = layout_for(model.config, block_tokens=8)
    _save(tmp_path, model)
    assert _cached(tmp_path, layout) == 40
    assert _cached(tmp_path, layout, revision="r1", weights=model) == 0
