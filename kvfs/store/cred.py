"""Who asks: a FUSE caller's credentials and the permission rule the store applies for them."""
from __future__ import annotations

import dataclasses

from kvfs.store.records import InodeRecord


@dataclasses.dataclass(frozen=True)
class Cred:
    """Who asks (the FUSE request's uid and gid, and the caller's supplementary groups)."""

    uid: int
    gid: int
    groups: frozenset = frozenset()

    def may(self, rec: InodeRecord, want: int) -> bool:
        """``default_permissions`` rules: owner, then group, then other bits (root passes)."""
        if self.uid == 0:
            return True
        mode = rec.mode
        if rec.uid == self.uid:
            bits = mode >> 6
        elif rec.gid == self.gid or rec.gid in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


ROOT = Cred(0, 0)
