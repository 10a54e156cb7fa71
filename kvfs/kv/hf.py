"""Hugging Face transformers integration: store and restore a causal LM's DynamicCache.

::

    from kvfs.kv.hf import PrefixCachedLM
    lm = PrefixCachedLM(model, kvfs.KVCache(mount, model=name, layout=layout_for(model.config)))
    logits, past, reused = lm.prefill(token_ids)     # reuses the longest cached prefix

A DynamicCache layer holds ``[batch=1, kv_heads, tokens, head_dim]`` keys and values; kvfs
stores ``[layers, 2, tokens, kv_heads, head_dim]``. Only full-attention caches (no sliding
window layers) are supported. Imports transformers lazily.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kvfs.kv.cache import KVCache
from kvfs.kv.layout import KVLayout

log = logging.getLogger(__name__)


def layout_for(config, *, dtype=None, block_tokens: int = 16) -> KVLayout:
    """The KVLayout of a transformers model config (Llama-style attention)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype, block_tokens=block_tokens)


def kv_from_cache(past) -> torch.Tensor:
    """``[L, 2, T, H, D]`` from a DynamicCache (batch size 1)."""
    layers = getattr(past, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers DynamicCache, got {type(past).__name__}")
    ks, vs = [], []
    for i, layer in enumerate(layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"layer {i} is a sliding-window cache; kvfs stores full-attention KV only")
        k, v = layer.keys, layer.values
        if k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"layer {i}: expected keys [1, H, T, D], got {tuple(k.shape)}")
        ks.append(k[0])
        vs.append(v[0])
    kv = torch.stack([torch.stack(ks), torch.stack(vs)], dim=1)    # [L, 2, H, T, D]
    return kv.transpose(2, 3)                                        # [L, 2, T, H, D] (a view)


def cache_from_kv(kv: torch.Tensor, config=None):
    """A DynamicCache holding ``kv`` (``[L, 2, T, H, D]``)."""
    from transformers import DynamicCache
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    past = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(kv.shape[0]):
        k = kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous()
        v = kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous()
        past.update(k, v, layer)
    return past


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    logits: torch.Tensor        # next-token logits after the prompt, [vocab]
    past: object                # the DynamicCache for the whole prompt
    reused_tokens: int          # tokens whose KV came from kvfs
    load_seconds: float
    compute_seconds: float


class PrefixCachedLM:
    """Prefill with reuse: load the cached prefix from kvfs, compute only the rest, save."""

    def __init__(self, model, cache: KVCache, *, save: bool = True):
        want = layout_for(model.config, dtype=cache.layout.torch_dtype, block_tokens=cache.layout.block_tokens)
        if dataclasses.replace(want, tp_rank=cache.layout.tp_rank, tp_size=cache.layout.tp_size) != cache.layout:
            raise ValueError(f"cache layout {cache.layout} does not match the model ({want})")
        self.model, self.cache, self.save = model, cache, save

    @torch.no_grad()
    def prefill(self, token_ids) -> PrefillResult:
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        device = next(self.model.parameters()).device
        B = self.cache.layout.block_tokens
        # keep at least one token to compute: it yields the next-token logits
        n = min(self.cache.lookup(ids), ((ids.numel() - 1) // B) * B)
        t0 = time.perf_counter()
        past = None
        if n:
            kv = self.cache.load(ids[:n], device=device)
            past = cache_from_kv(kv, self.model.config)
        t1 = time.perf_counter()
        out = self.model(input_ids=ids[n:].unsqueeze(0).to(device), past_key_values=past, use_cache=True)
        t2 = time.perf_counter()
        if self.save:
            self.cache.save(ids, kv_from_cache(out.past_key_values))
        log.debug("prefill of %d tokens: %d reused (%.3fs load), %d computed (%.3fs)",
                  ids.numel(), n, t1 - t0, ids.numel() - n, t2 - t1)
        return PrefillResult(out.logits[0, -1].float(), out.past_key_values, n, t1 - t0, t2 - t1)


def random_llama(*, layers: int = 8, hidden: int = 1024, heads: int = 16, kv_heads: int = 4,
                 intermediate: int = 2816, vocab: int = 32000, max_positions: int = 4096, seed: int = 0,
                 dtype=torch.float32):
    """A randomly initialised Llama-architecture causal LM (no weight download)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return model
