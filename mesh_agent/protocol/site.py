"""Site frames: many devices' frames in one gateway-signed envelope over a site's uplink.

Why: a site gateway used to relay each device frame as one MQTT message on the device's own
topic, so a site of ten idle devices paid ten envelopes, ten MQTT headers and ten PUBACKs where
one would do, and the bytes never met a compressor (docs/sites.md, "Site frames"). A ``site_up``
(gateway to hub) or ``site_down`` (hub to gateway) envelope is signed with the **gateway's** key
and carries a list of inner frames, each exactly as its signer made it: a device's frame with the
device's MAC, a hub frame with the hub's MAC for that device. The outer MAC only says which
gateway sent the batch; every inner frame is verified by its receiver exactly as if it had come on
its own (key, MAC, direction, freshness, replay), and the hub also checks that each inner frame's
endpoint is a device of this gateway. So a gateway can still delay or drop, never forge or alter.

Body, a msgpack map (compressed as a whole by the envelope when it shrinks)::

    {"d": [device id, ...],            # this batch's device table: each id once; an id of the
                                       # form "ep-" + 12 lowercase hex digits may be its 6 bytes
                                       # (bin), any other id is its string (compact ids, below)
     "f": [[index into d, frame], ...], # the inner frames, in the order they were produced
     "n": seq,                          # optional: the sender's batch number
     "e": numbering,                    # optional: names the site_down numbering "n" belongs to
     "b": floor,                        # optional (site_down): every batch of this numbering below b
                                        # is settled at the hub (confirmed, or its tasks re-queued)
     "s": {"l": [[index, lan, epoch, capacity, running, queued, stored, outbox, want], ...],
           "x": [[index, {heartbeat fields that changed}], ...],
           "c": [numbering, n]}}        # optional: the site's own section; "l": liveness rows (ROW_FIELDS),
                                        # "c": every site_down of that numbering up to n is stored

Compact ids: the only ids the gateway or the hub writes in a batch are the device table's (every
inner frame is signed by its device or by the hub and stays byte for byte as it was, so the ids
inside it, endpoint, task and function ids, stay strings). A sender may write a table entry of the
known form as 6 bytes instead of a 16-byte msgpack string; it does so only towards a peer that said
it reads them (``bin: 1`` in the gateway's ``hello.site`` and in the hub's ``welcome.site``), since
an older peer refuses a batch with a binary id as a whole (``d must hold short ascii device ids``).
Every reader decodes both forms.

Pure: no I/O. :class:`SiteBatch` is the sender's accumulator; who flushes it, and when, is the
caller's business (a window in seconds, a size in bytes, at once for a hello).
"""

from __future__ import annotations

from typing import Any

from mesh_agent.protocol.envelope import BadFrame, Kind

__all__ = ["SITE_FLUSH_BYTES", "SITE_MAX_FRAMES", "SITE_MAX_BYTES", "ROW_FIELDS", "SiteBatch", "site_body", "inner_frames",
           "check_site_body", "summary_rows", "stored_upto", "settled_below", "pack_id", "unpack_id", "device_table"]

#: A batch is flushed once its inner frames add up to this many bytes (before compression).
SITE_FLUSH_BYTES = 16 * 1024
#: At most this many inner frames per batch, and this many bytes of them: bounds what one
#: envelope can make a receiver hold and verify.
SITE_MAX_FRAMES = 4096
SITE_MAX_BYTES = 8 * 1024 * 1024
_MAX_ID_LEN = 255
#: One liveness row per device in a site_up's ``s.l`` (after the device's index into ``d``): on the
#: site's LAN (1) or not (0), its connection epoch (hellos the gateway saw from it), then the
#: counters of its last heartbeat. Small ints: a row of an idle device packs into about 12 bytes.
ROW_FIELDS = ("lan", "epoch", "capacity", "running", "queued", "stored", "outbox", "want")
#: An endpoint id as the hub mints it (enrollment): this prefix and 12 lowercase hex digits.
_EP_PREFIX = "ep-"
_EP_HEX = 12
_HEX = frozenset("0123456789abcdef")


def pack_id(endpoint: str) -> bytes | str:
    """A device table entry: the 6 bytes of an id of the known form ("ep-" + 12 lowercase hex
    digits: 8 bytes in msgpack instead of 16), any other id as it is."""
    digits = endpoint[len(_EP_PREFIX):]
    if endpoint.startswith(_EP_PREFIX) and len(digits) == _EP_HEX and set(digits) <= _HEX:
        return bytes.fromhex(digits)
    return endpoint


def unpack_id(entry: Any) -> str:
    """The endpoint id a device table entry stands for; :class:`BadFrame` for anything that is not
    6 bytes or a short ascii string, so a malformed table refuses the batch before any frame in it
    is looked at."""
    if type(entry) is bytes:
        if len(entry) != _EP_HEX // 2:
            raise BadFrame(f"a binary device id must be {_EP_HEX // 2} bytes, got {len(entry)}")
        return _EP_PREFIX + entry.hex()
    if type(entry) is str and 0 < len(entry) <= _MAX_ID_LEN and entry.isascii():
        return entry
    raise BadFrame("a device id must be 6 bytes or a short ascii string")


def device_table(body: dict[str, Any]) -> list[str]:
    """The ids of a checked site body's device table (``d``), binary entries decoded."""
    return [unpack_id(entry) for entry in body["d"]]


def site_body(frames: list[tuple[str, bytes]], *, seq: int | None = None, epoch: str | None = None, floor: int | None = None,
              rows: dict[str, list[int]] | None = None, info: dict[str, dict[str, Any]] | None = None,
              stored: tuple[str, int] | None = None, binary_ids: bool = False) -> dict[str, Any]:
    """The body of a ``site_up``/``site_down`` envelope carrying ``frames`` ((device id, frame) pairs,
    in order) and, for a site_up, liveness ``rows`` (device id -> the values of :data:`ROW_FIELDS`)
    and ``info`` (device id -> the other heartbeat fields that changed: resources, device counters).
    ``seq``/``epoch``: a site_down's number in its numbering; ``floor``: every site_down of that
    numbering below it is settled (the gateway's "stored up to" may skip a batch the hub gave up
    on, so one lost batch does not stop cumulative confirmation for good); ``stored``: a site_up's confirmation
    that every site_down of that numbering up to that number is stored at the gateway. ``binary_ids``:
    write the device table's ids of the known form as 6 bytes each (only to a peer that reads them)."""
    devices: list[str] = []
    index: dict[str, int] = {}

    def at(device: str) -> int:
        i = index.get(device)
        if i is None:
            i = index[device] = len(devices)
            devices.append(device)
        return i

    body: dict[str, Any] = {"d": devices, "f": [[at(device), frame] for device, frame in frames]}
    if seq is not None:
        body["n"] = int(seq)
    if epoch is not None:
        body["e"] = epoch
    if floor is not None:
        body["b"] = int(floor)
    site: dict[str, Any] = {}
    if stored is not None:
        site["c"] = [stored[0], int(stored[1])]
    if rows:
        site["l"] = [[at(device), *values] for device, values in rows.items()]
    if info:
        site["x"] = [[at(device), fields] for device, fields in info.items()]
    if site:
        body["s"] = site
    if binary_ids:  # last: the rows above may add devices to the table
        body["d"] = [pack_id(device) for device in devices]
    return body


def check_site_body(kind: Kind, body: dict[str, Any]) -> None:
    """Shape check (mesh_agent/protocol/bodies.py calls it): raise :class:`BadFrame` naming the field."""
    d, f = body.get("d"), body.get("f")
    if type(d) is not list or len(d) > SITE_MAX_FRAMES:
        raise BadFrame(f"{kind.value} body: d must be a list of at most {SITE_MAX_FRAMES} device ids")
    for n, dev in enumerate(d):
        try:
            unpack_id(dev)
        except BadFrame as exc:
            raise BadFrame(f"{kind.value} body: d[{n}]: {exc}") from None
    if type(f) is not list or len(f) > SITE_MAX_FRAMES:
        raise BadFrame(f"{kind.value} body: f must be a list of at most {SITE_MAX_FRAMES} frames")
    total = 0
    for n, item in enumerate(f):
        if type(item) is not list or len(item) != 2 or type(item[0]) is not int or not 0 <= item[0] < len(d) \
                or type(item[1]) is not bytes:
            raise BadFrame(f"{kind.value} body: f[{n}] must be [device index, frame bytes]")
        total += len(item[1])
    if total > SITE_MAX_BYTES:
        raise BadFrame(f"{kind.value} body: inner frames of {total} bytes exceed {SITE_MAX_BYTES}")
    for key in ("n", "b"):
        if key in body and (type(body[key]) is not int or body[key] < 0):
            raise BadFrame(f"{kind.value} body: {key} must be an int >= 0")
    if "s" in body and type(body["s"]) is not dict:
        raise BadFrame(f"{kind.value} body: s must be a map")
    if "e" in body and (type(body["e"]) is not str or not 0 < len(body["e"]) <= 16):
        raise BadFrame(f"{kind.value} body: e must be a short string")
    c = body.get("s", {}).get("c")
    if c is not None and (type(c) is not list or len(c) != 2 or type(c[0]) is not str or not 0 < len(c[0]) <= 16
                          or type(c[1]) is not int or c[1] < 0):
        raise BadFrame(f"{kind.value} body: s.c must be [numbering, stored up to]")
    _indexed(kind, body, "l", len(d), lambda v: type(v) is list and len(v) == 1 + len(ROW_FIELDS)
                    and all(type(x) is int and 0 <= x < 2**31 for x in v),
                    f"[device index, {', '.join(ROW_FIELDS)}], ints >= 0")
    _indexed(kind, body, "x", len(d), lambda v: type(v) is list and len(v) == 2 and type(v[1]) is dict
                    and type(v[0]) is int, "[device index, map]")


def _indexed(kind: Kind, body: dict[str, Any], key: str, devices: int, ok: Any, what: str) -> None:
    """Check ``s.<key>``: a bounded list whose entries pass ``ok`` and start with an index into ``d``."""
    entries = body.get("s", {}).get(key)
    if entries is None:
        return
    if type(entries) is not list or len(entries) > SITE_MAX_FRAMES:
        raise BadFrame(f"{kind.value} body: s.{key} must be a list of at most {SITE_MAX_FRAMES} entries")
    for n, entry in enumerate(entries):
        if not ok(entry) or not 0 <= entry[0] < devices:
            raise BadFrame(f"{kind.value} body: s.{key}[{n}] must be {what}")


def inner_frames(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(device id, frame) pairs of a checked site body, in order. Nothing in them is verified yet."""
    devices = device_table(body)
    return [(devices[i], frame) for i, frame in body["f"]]


def summary_rows(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(device id, {field: value}) of each liveness row of a checked site body (none: []), with the
    device's changed heartbeat fields (``s.x``; their shapes are the heartbeat's, checked by the
    receiver) merged under the row's: the row decides liveness and queue counts."""
    devices = device_table(body)
    site = body.get("s") or {}
    extra: dict[str, dict[str, Any]] = {devices[i]: fields for i, fields in site.get("x") or ()}
    return [(devices[row[0]], {**extra.get(devices[row[0]], {}), **dict(zip(ROW_FIELDS, row[1:]))}) for row in site.get("l") or ()]


def stored_upto(body: dict[str, Any]) -> tuple[str, int] | None:
    """A checked site_up's "stored up to": (numbering, n), or None."""
    c = (body.get("s") or {}).get("c")
    return (c[0], c[1]) if c else None


def settled_below(body: dict[str, Any]) -> int | None:
    """A checked site_down's floor ``b``: every batch of its numbering below it is settled, or None."""
    b = body.get("b")
    return b if type(b) is int else None


class SiteBatch:
    """Frames waiting to go out in one site envelope: add, ask whether it is due, take."""

    def __init__(self, flush_bytes: int = SITE_FLUSH_BYTES) -> None:
        self.flush_bytes = flush_bytes
        self.frames: list[tuple[str, bytes]] = []
        self.nbytes = 0

    def add(self, device: str, frame: bytes) -> bool:
        """Queue one inner frame; True when the batch should go now (size or count reached)."""
        self.frames.append((device, frame))
        self.nbytes += len(frame)
        return self.nbytes >= self.flush_bytes or len(self.frames) >= SITE_MAX_FRAMES

    def take(self) -> list[tuple[str, bytes]]:
        """Everything queued, in order; the batch is empty after."""
        out, self.frames, self.nbytes = self.frames, [], 0
        return out

    def __len__(self) -> int:
        return len(self.frames)
