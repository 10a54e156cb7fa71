"""Initiator exceptions and NVMe status-code decoding.

``TransportError`` and its subclasses mean the connection is gone (dropped,
timed out, or the target broke the protocol): the controller is unusable and
must be reconnected. ``NvmeStatusError`` is a command the controller completed
with an error status; the connection stays up.
"""
from __future__ import annotations


class NvmeError(Exception):
    """Base of everything the initiator raises."""


class TransportError(NvmeError):
    """The connection is lost or unusable; every command in flight fails with it."""


class ProtocolError(TransportError):
    """The target sent something that violates NVMe/TCP (bad length, type, id, digest...)."""


class CommandTimeout(TransportError):
    """A command got no completion within its timeout; the connection is dropped."""


class TargetTerminated(TransportError):
    """The target sent a C2HTermReq (fatal transport error on its side)."""


class UrlError(NvmeError, ValueError):
    """An nvme-tcp:// URL that cannot be used."""


_GENERIC = {
    0x00: "Successful Completion", 0x01: "Invalid Command Opcode", 0x02: "Invalid Field in Command",
    0x03: "Command ID Conflict", 0x04: "Data Transfer Error", 0x05: "Commands Aborted due to Power Loss",
    0x06: "Internal Error", 0x07: "Command Abort Requested", 0x08: "Command Aborted due to SQ Deletion",
    0x0A: "Invalid Namespace or Format", 0x0B: "Invalid Namespace or Format", 0x0C: "Command Sequence Error",
    0x0D: "Invalid SGL Segment Descriptor", 0x0E: "Invalid Number of SGL Descriptors",
    0x0F: "Data SGL Length Invalid", 0x10: "Metadata SGL Length Invalid", 0x11: "SGL Descriptor Type Invalid",
    0x15: "Operation Denied", 0x16: "SGL Offset Invalid", 0x1F: "Namespace is Write Protected",
    0x20: "Command Interrupted", 0x21: "Transient Transport Error",
    0x80: "LBA Out of Range", 0x81: "Capacity Exceeded", 0x82: "Namespace Not Ready",
    0x83: "Reservation Conflict", 0x84: "Format In Progress",
}
_COMMAND_SPECIFIC = {
    0x01: "Invalid Queue Identifier", 0x02: "Invalid Queue Size", 0x06: "Invalid Firmware Slot",
    0x0B: "Invalid Namespace or Format", 0x0D: "Feature Identifier Not Saveable",
    0x80: "Incompatible Format / Conflicting Attributes", 0x81: "Controller Busy / Invalid Protection Information",
    0x82: "Connect Invalid Parameters / Attempted Write to Read Only Range", 0x83: "Connect Restart Discovery",
    0x84: "Connect Invalid Host", 0x85: "Invalid Queue Type", 0x90: "Discover Restart",
    0x91: "Authentication Required",
}
_MEDIA = {
    0x80: "Write Fault", 0x81: "Unrecovered Read Error", 0x82: "End-to-end Guard Check Error",
    0x83: "End-to-end Application Tag Check Error", 0x84: "End-to-end Reference Tag Check Error",
    0x85: "Compare Failure", 0x86: "Access Denied", 0x87: "Deallocated or Unwritten Logical Block",
}
_PATH = {
    0x00: "Internal Path Error", 0x01: "Asymmetric Access Persistent Loss",
    0x02: "Asymmetric Access Inaccessible", 0x03: "Asymmetric Access Transition",
    0x60: "Controller Pathing Error", 0x70: "Host Pathing Error", 0x71: "Command Aborted By Host",
}
_TYPES = {0: ("Generic", _GENERIC), 1: ("Command Specific", _COMMAND_SPECIFIC),
          2: ("Media and Data Integrity", _MEDIA), 3: ("Path Related", _PATH),
          7: ("Vendor Specific", {})}


def describe_status(sct: int, sc: int) -> str:
    tname, table = _TYPES.get(sct, (f"SCT {sct:#x}", {}))
    return f"{table.get(sc, f'status {sc:#04x}')} ({tname}, sct={sct:#x} sc={sc:#04x})"


class NvmeStatusError(NvmeError):
    """The controller completed a command with a non-zero status."""

    def __init__(self, opcode: int, status: int, what: str = ""):
        self.opcode = opcode
        self.status = status            # the 15-bit status field (phase bit removed)
        self.sc = status & 0xFF
        self.sct = (status >> 8) & 0x7
        self.crd = (status >> 11) & 0x3
        self.more = bool(status & 0x2000)
        self.dnr = bool(status & 0x4000)
        super().__init__(f"{what or f'opcode {opcode:#04x}'} failed: {describe_status(self.sct, self.sc)}"
                         + (" [DNR]" if self.dnr else ""))
