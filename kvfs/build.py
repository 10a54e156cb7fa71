"""Config -> tiers, store and the hooks between packages: the one composition root the daemon,
fsck and tests share.

Here ``Config`` becomes plain arguments for every tier (the tiers never read it), the store's
facade is assembled, fsck is handed what it checks, and a shared volume's names are hooked
into the tier, the store and the fs layer (no other module sets a hook on another package's
object). Nothing process-related lives here (no FUSE session, signals or mount handling: that
is kvfs.daemon), so offline tools build exactly the tiers and store a mount would.
"""
from __future__ import annotations

import logging
import time

from kvfs.config import Config
from kvfs.errors import ConfigError
from kvfs.store.fsck import Layout
from kvfs.store.index import Index
from kvfs.store.names import NameTable, dirent_count
from kvfs.store.nvme import NvmeTier
from kvfs.store.objects import ObjectStore
from kvfs.store.prefix import PrefixRule
from kvfs.store.ram import RamTier
from kvfs.store.store import Store

log = logging.getLogger(__name__)


def build_tiers(cfg: Config, index: Index, holder: str | None = None) -> list:
    """RAM, local NVMe and (when configured) the remote tier, top to bottom."""
    ram = RamTier(cfg.ram_bytes(), cfg.shm_dir, index.instance_id, mapped_min=cfg.ram_mapped_min,
                  own_fs=cfg.ram_hugefs)
    return [ram, *durable_tiers(cfg, index, holder)]


def durable_tiers(cfg: Config, index: Index, holder: str | None = None) -> list:
    """Local NVMe and (when configured) the remote tier: the tiers that outlive the daemon."""
    tiers = [NvmeTier(cfg.nvme_bytes(), cfg.nvme_dir, holder=holder)]
    if cfg.remote:
        tiers.append(build_remote_tier(cfg, index.instance_id))
    return tiers


def build_remote_tier(cfg: Config, instance_id: str):
    """The remote tier of ``cfg.remote`` (built, not opened), shared when ``cfg.share``."""
    from kvfs.remote import make_remote_tier
    shared = None
    if cfg.share:
        shared = dict(node_id=cfg.node_id, max_nodes=cfg.share_max_nodes, poll=float(cfg.share_poll),
                      lease=float(cfg.share_lease), grace=None if cfg.share_grace < 0 else float(cfg.share_grace),
                      takeover=bool(cfg.share_takeover))
    return make_remote_tier(str(cfg.remote), instance_id, size=cfg.remote_size, format=bool(cfg.remote_format),
                            shared=shared)


def build_store(cfg: Config, index: Index, tiers: list) -> ObjectStore:
    ram = next(t for t in tiers if isinstance(t, RamTier))
    store = ObjectStore(index, tiers, ram=ram, prefix=PrefixRule(index), chunk_size=cfg.chunk_size,
                        high=cfg.high_watermark, low=cfg.low_watermark, promote_hits=cfg.promote_hits,
                        promote_window=cfg.promote_window, admit_after=cfg.admission(),
                        read_deadline=float(cfg.read_deadline))
    store.events.queue_limit = cfg.events_queue
    return store


def build_kvstore(cfg: Config, index: Index, tiers: list) -> Store:
    """The store the fs layer calls (``Store``: its members over the object store of
    ``tiers``, opened, and ``index``); not started (``Store.start``)."""
    spill = next(t for t in tiers if isinstance(t, NvmeTier)).staging_dir
    return Store(index, build_store(cfg, index, tiers), spill)


def build_ops(kvstore: Store, describe):
    """The fs layer over ``kvstore``, hooked into it: the quotas, and the kernel told when a
    file's content changes or a write is sealed. ``describe``: the daemon's part of
    ``.kvfs/stats``."""
    from kvfs.fs.ops import KvfsOperations
    ops = KvfsOperations(kvstore, describe)
    kvstore.quotas = ops.quotas
    kvstore.files.on_content_changed = ops.kernel.content_changed
    kvstore.files.on_sealed = ops.kernel.sealed
    kvstore.store.on_copy_dropped = ops.opens.copy_dropped
    return ops


def build_names(cfg: Config, index: Index, where) -> NameTable:
    """The name table in ``where``, handed to ``index`` (which enters every change of names in
    it from now on), started empty and unadvertised: kvfs.store.names.build_in_background fills
    it from the index after the mount is ready. Never started on a shared volume (a local miss
    may be another node's name)."""
    names = NameTable(str(where))
    try:
        if not cfg.share:
            index.commit()          # the build reads LMDB: nothing may stay in the pending table
            names.begin(dirent_count(index))
    except OSError as e:
        log.warning("no name table (%s): clients use lookups", e)
    index.names = names
    return names


def detach_names(index: Index) -> None:
    """The index's name table, if any, taken from it and closed (unmounted: readers stop
    answering from it)."""
    names, index.names = index.names, None
    if names is not None:
        names.close()


def fsck_layout(cfg: Config) -> Layout:
    """What ``kvfs fsck`` checks for ``cfg``: its state directory and the durable tiers a mount
    of it would build."""
    return Layout(cfg.state_dir, cfg.nvme_dir, lambda index: durable_tiers(cfg, index))


async def attach_shared(kvstore: Store, tiers: list, ops) -> None:
    """When the remote tier is a shared volume (after the store has loaded): its names, hooked
    into the tier (blocks their owners dropped), the store (renames to publish) and the fs
    layer ``ops`` (lookups, readdirs and control files that miss locally ask it); first they
    reconcile the names adopted before a restart with the view."""
    from kvfs.remote.share.adopt import SharedNames
    from kvfs.remote.share.tier import SharedRemoteTier
    tier = next((t for t in tiers if isinstance(t, SharedRemoteTier) and t.sb2 is not None), None)
    if tier is None:
        return
    names = SharedNames(kvstore.ns, kvstore.index, kvstore.store, tier, kernel_synced=ops.kernel.synced)
    tier.on_dropped = names.dropped_by_owner
    tier.names = names
    kvstore.on_renamed = names.renamed
    await names.reconcile()
    await names.republish_renamed()
    ops.shared = ops.control.shared = names


def _attach(fuse, sock: str, options: set[str], epoch: int, find_object):
    """Take the session the supervisor holds (kvfs/supervisor.py) instead of mounting."""
    from kvfs import handover
    from kvfs.fs import notifyproc
    if not hasattr(fuse, "attach"):
        raise ConfigError(f"a supervised mount needs kvfs's own FUSE transport ({fuse.why})")
    try:
        sup = handover.attach(sock, sorted(options))
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"the supervisor did not hand over the session: {e}") from None
    if sup.epoch != epoch:
        raise ConfigError(f"the supervisor's epoch {sup.epoch} is not this daemon's ({epoch})")
    notifyproc.SUPERVISED = True        # the helper leaves the queue to the next daemon
    fuse.attach(sup.fd, sup.agreed, sup.epoch)
    fuse.handlers.passthrough.journal = sup.tell        # registrations, for the next daemon
    if sup.agreed is not None:
        fuse.handlers.passthrough.adopt(sup.reply.get("backing") or [], find_object)
    fuse.handlers.session.on_init = lambda agreed: sup.tell({"op": "agreed", "agreed": agreed})
    return sup


def _note_pause(sup, fuse, stats: dict) -> None:
    """Once the attached daemon answered its first request: the pause its predecessor's end
    cost, from the supervisor's ``died_at`` (CLOCK_MONOTONIC is the machine's), to the
    supervisor, the log and ``.kvfs/stats``."""
    died = sup.reply.get("died_at")
    attached = stats["attached_at"]

    def first(at: float) -> None:
        if died is None:
            return
        note = {"pause_s": round(at - died, 4), "ready_s": round(attached - died, 4), "resend": fuse.resend}
        if sup.history:
            sup.history[-1].update(note)
        stats.update(sup.statistics())
        log.info("served the first request %.3fs after the last daemon ended (ready after %.3fs; resend %s)",
                 note["pause_s"], note["ready_s"], fuse.resend)
        sup.tell({"op": "served", **note})
    fuse.handlers.on_first_answer = first


def take_session(cfg: Config, fuse, kvstore: Store, ops, served: dict, attach: str | None,
                 epoch: int, options: set[str]) -> None:
    """Mount, or (``attach``: the supervisor's socket) take the session the supervisor holds,
    hook the daemon to it (its journal, INIT's agreement, the pause), and start the kernel's
    notifications. A daemon that took a session over invalidates the names its crash start
    dropped (unsealed, RAM-only): that kernel may still cache them."""
    if attach:
        sup = _attach(fuse, attach, options, epoch, kvstore.store.objs.get)
        served["supervisor"] = dict(sup.statistics(), attached_at=time.monotonic())
        _note_pause(sup, fuse, served["supervisor"])
    else:
        if cfg.supervise:
            why = "in the foreground" if cfg.foreground else getattr(fuse, "why", "not started by one")
            log.warning("no supervisor (%s): a daemon's death leaves the mount answering ENOTCONN", why)
            served["supervisor"] = {"state": f"off ({why})"}
        fuse.mount()
    ops.kernel.start(fuse.notify_direct())
    if attach and fuse.resend is not None:
        for parent, name, ino in kvstore.dropped_names:
            ops.kernel.name_removed(parent, name, ino)
        if kvstore.dropped_names:
            log.info("%d names dropped by the crash start invalidated in the kernel",
                     len(kvstore.dropped_names))
        kvstore.dropped_names.clear()
