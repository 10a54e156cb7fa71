"""Config -> tiers and store: the wiring the daemon, fsck and tests share.

Nothing process-related lives here (no FUSE session, signals or mount handling: that is
kvfs.daemon), so offline tools build exactly the tiers and store a mount would.
"""
from __future__ import annotations

import logging

from kvfs.config import Config
from kvfs.store.index import Index
from kvfs.store.nvme import NvmeTier
from kvfs.store.objects import ObjectStore
from kvfs.store.prefix import PrefixRule
from kvfs.store.ram import RamTier

log = logging.getLogger(__name__)


def build_tiers(cfg: Config, index: Index, holder: str | None = None) -> list:
    """RAM, local NVMe and (when configured) the remote tier, top to bottom."""
    tiers = [RamTier(cfg.ram_bytes(), cfg.shm_dir, index.instance_id, mapped_min=cfg.ram_mapped_min,
                     own_fs=cfg.ram_hugefs),
             NvmeTier(cfg.nvme_bytes(), cfg.nvme_dir, holder=holder)]
    if cfg.remote:
        from kvfs.remote import make_remote_tier
        tiers.append(make_remote_tier(cfg, index.instance_id))
    return tiers


def build_store(cfg: Config, index: Index, tiers: list) -> ObjectStore:
    ram = next(t for t in tiers if isinstance(t, RamTier))
    return ObjectStore(index, tiers, ram=ram, prefix=PrefixRule(index), chunk_size=cfg.chunk_size,
                       high=cfg.high_watermark, low=cfg.low_watermark, promote_hits=cfg.promote_hits,
                       promote_window=cfg.promote_window, admit_after=cfg.admission(),
                       read_deadline=float(cfg.read_deadline))
