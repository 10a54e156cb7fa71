"""The weights' identity: a fingerprint of every byte of a model's weights.

KV computed by one set of weights is wrong for any other, even under the same model name (a
fine-tune published under the base model's id, a re-quantised checkpoint, another dtype). A
``KVCache`` given the model (or this fingerprint) puts it in its namespace, so KV saved by
other weights is a miss, never a hit.

::

    fp = weights_fingerprint(model)       # once per load: ~8.6 GB/s on one CPU core here
    cache = kvfs.KVCache(mount, model="org/name", layout=layout, revision="v1.2", weights=fp)

The hash is one streaming xxh3-128 over the model's ``state_dict`` (parameters and persistent
buffers), entries in sorted name order, each as its name, dtype, shape and raw bytes; a tensor
tied to one already hashed (the same storage, offset, shape and stride: tied embeddings)
contributes its name and the name it aliases, not its bytes again. Tensors on an accelerator
are copied to host memory in pieces of at most ``piece_bytes``. The result does not depend on
the device, the process or ``PYTHONHASHSEED``; it changes with any byte, the dtype, a shape or a
parameter's name.
"""
from __future__ import annotations

import collections.abc

import xxhash

PREFIX = "xxh3-128:"
PIECE_BYTES = 256 << 20


def _named_tensors(model) -> dict:
    if isinstance(model, collections.abc.Mapping):
        return dict(model)
    state_dict = getattr(model, "state_dict", None)
    if state_dict is None:
        raise TypeError(f"expected a torch.nn.Module or a mapping of name -> tensor, got {type(model).__name__}")
    return state_dict(keep_vars=False)


def alias_key(t) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()), str(t.dtype))


def weights_fingerprint(model, *, piece_bytes: int = PIECE_BYTES) -> str:
    """``"xxh3-128:<32 hex>"`` over all of ``model``'s weights (a ``torch.nn.Module``, or a
    mapping of name -> tensor such as a state dict). Reads every byte once: compute it once per
    load and pass the string to each ``KVCache``."""
    import torch

    h = xxhash.xxh3_128()
    seen: dict[tuple, str] = {}
    tensors = _named_tensors(model)
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: not a tensor ({type(t).__name__})")
        t = t.detach()
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device: its weights are not loaded")
        h.update(f"{name}\0{str(t.dtype)}\0{list(t.shape)}\0".encode())
        key = alias_key(t)
        if key in seen:
            h.update(f"=\0{seen[key]}\0".encode())
            continue
        seen[key] = name
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        try:
            raw = flat.contiguous().view(torch.uint8)
        except (RuntimeError, TypeError) as e:
            raise TypeError(f"{name}: cannot read the bytes of a {type(t).__name__} "
                            f"({e}); pass revision= instead") from None
        step = max(1, piece_bytes)
        for start in range(0, raw.numel(), step):
            piece = raw[start:start + step]
            if piece.device.type != "cpu":
                piece = piece.to("cpu")
            h.update(piece.numpy())
    return PREFIX + h.hexdigest()
