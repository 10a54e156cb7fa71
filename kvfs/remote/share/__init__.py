"""Scale-out: several kvfs nodes on one shared remote volume (format 2; docs/scale-out.md)."""
from __future__ import annotations


async def attach(cache, tiers, kernel_synced=None):
    """The SharedNames of the mount when its remote tier is shared, else None (after the
    store has loaded: it reconciles the names adopted before a restart with the view).
    ``kernel_synced``: async (), returns once the kernel's caches dropped what was removed."""
    from kvfs.remote.share.adopt import SharedNames
    from kvfs.remote.share.tier import SharedRemoteTier
    for t in tiers:
        if isinstance(t, SharedRemoteTier) and t.sb2 is not None:
            names = SharedNames(cache, t)
            names.kernel_synced = kernel_synced
            await names.reconcile()
            await names.republish_renamed()
            return names
    return None
