"""transformers integration: a random Llama's DynamicCache through kvfs gives the same logits."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvfs  # noqa: E402
from kvfs.kv.hf import PrefixCachedLM, cache_from_kv, kv_from_cache, layout_for, random_llama  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_llama(layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1000)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def test_layout_for_llama(model):
    lay = layout_for(model.config, block_tokens=16)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) == (3, 2, 32, "float32")


@torch.no_grad()
def test_dynamic_cache_roundtrip(model):
    ids = torch.tensor([_prompt(40, 1)])
    past = model(input_ids=ids, use_cache=True).past_key_values
    kv = kv_from_cache(past)
    assert tuple(kv.shape) == (3, 2, 40, 2, 32)
    back = cache_from_kv(kv, model.config)
    for a, b in zip(past.layers, back.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@torch.no_grad()
def test_reuse_gives_the_logits_of_recompute(tmp_path, model):
    cache = kvfs.KVCache(tmp_path, "random-llama", layout_for(model.config, block_tokens=16))
    lm = PrefixCachedLM(model, cache)
    shared = _prompt(150, 2)
    first = lm.prefill(shared + _prompt(30, 3))
    cache.flush()
    assert first.reused_tokens == 0
    prompt = shared + _prompt(45, 4)
    reused = lm.prefill(prompt)
    assert reused.reused_tokens == 144                  # 150 shared tokens -> 9 whole blocks
    # the same split computed in memory (no kvfs): bit-identical logits
    ids = torch.tensor([prompt])
    head = model(input_ids=ids[:, :144], use_cache=True)
    split = model(input_ids=ids[:, 144:], past_key_values=head.past_key_values, use_cache=True).logits[0, -1]
    assert torch.equal(reused.logits, split)
    # and a full recompute agrees to float32 rounding, with the same next token
    full = model(input_ids=ids).logits[0, -1]
    assert torch.allclose(reused.logits, full, atol=1e-5, rtol=1e-4)
    assert int(reused.logits.argmax()) == int(full.argmax())
    # the KV kvfs restored is exactly what the model computed for the prefix (the in-memory
    # cache has since grown by the split forward)
    assert torch.equal(cache.load(prompt[:144]), kv_from_cache(head.past_key_values)[:, :, :144])
    cache.close()


def test_layout_mismatch_is_rejected(tmp_path, model):
    other = kvfs.KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32")
    with pytest.raises(ValueError, match="does not match"):
        PrefixCachedLM(model, kvfs.KVCache(tmp_path, "m", other))
