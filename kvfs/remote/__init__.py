"""The remote tier: a userspace NVMe/TCP initiator (or a kernel block device / file) under an
object store laid out on the raw volume. ``make_remote_tier`` is what the store calls."""
from __future__ import annotations

import logging

from kvfs.errors import ConfigError

log = logging.getLogger(__name__)


def make_volume(target: str, *, instance_id: str = "", create_size: int = 0, read_only: bool = False):
    """A Volume for ``nvme-tcp://…`` or a block-device/file path (ConfigError on a bad URL);
    ``read_only``: a file or device is opened O_RDONLY (an NVMe/TCP volume is only read by
    its caller)."""
    from kvfs.remote.errors import UrlError
    from kvfs.remote.url import is_nvme_tcp, parse_url
    if is_nvme_tcp(target):
        from kvfs.remote.volume import NvmeTcpVolume
        try:
            return NvmeTcpVolume(parse_url(target, instance_id=instance_id))
        except UrlError as e:
            raise ConfigError(f"bad --remote URL: {e}") from None
    if "://" in target:
        raise ConfigError(f"bad --remote {target!r}: use nvme-tcp://HOST:PORT/SUBNQN or a device/file path")
    from kvfs.remote.blockdev import FileVolume
    return FileVolume(target, create_size=create_size, read_only=read_only)


def make_remote_tier(cfg, instance_id: str):
    """Build (not open) the RemoteTier for ``cfg.remote`` / ``cfg.remote_size`` / ``cfg.remote_format``."""
    from kvfs.config import parse_size
    from kvfs.remote.tier import RemoteTier
    target = str(cfg.remote).strip()
    if not target:
        raise ConfigError("no --remote given")
    size = cfg.remote_size
    create = 0
    if not str(size).strip().endswith("%"):
        create = parse_size(size)
    vol = make_volume(target, instance_id=instance_id, create_size=create)
    if getattr(cfg, "share", False):
        from kvfs.remote.share.tier import SharedRemoteTier
        url = getattr(vol, "url", None)
        return SharedRemoteTier(vol, instance_id=instance_id, node_id=cfg.node_id,
                                hostnqn=url.hostnqn if url is not None else "",
                                format=bool(cfg.remote_format), max_nodes=cfg.share_max_nodes,
                                poll=float(cfg.share_poll), lease=float(cfg.share_lease),
                                grace=None if cfg.share_grace < 0 else float(cfg.share_grace),
                                takeover=bool(cfg.share_takeover), describe=target.split("?", 1)[0])
    return RemoteTier(vol, instance_id=instance_id, size=size, format=bool(cfg.remote_format),
                      describe=target.split("?", 1)[0])


__all__ = ["make_remote_tier", "make_volume"]
