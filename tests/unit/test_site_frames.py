"""Site frames (mesh_agent/protocol/site.py, cloud_hub/site_frames.py; docs/sites.md "Site frames").

Pure checks: the body round-trips in order with a device table; a malformed body is one clear
BadFrame; the hub's split refuses an inner frame for a device that is not the gateway's, and one
whose clear header names another endpoint than its listing; inner frames stay byte for byte what
their signer made (the gateway cannot re-sign them), so a flipped byte still fails the device's MAC.
"""

from __future__ import annotations

import time

import pytest

from cloud_hub.site_frames import split_site_up
from mesh_agent.protocol import BadFrame, BadSignature, Envelope, Kind, decode, encode, new_key
from mesh_agent.protocol.bodies import validate_body
from mesh_agent.protocol.site import SITE_FLUSH_BYTES, SITE_MAX_FRAMES, SiteBatch, inner_frames, settled_below, site_body, summary_rows

KA, KB = new_key(), new_key()


def beat(ep: str, key: bytes, **body: int) -> bytes:
    return encode(Envelope(Kind.HEARTBEAT, ep, dict(body) or {"want": 1}, ts=time.time()), key)


def roundtrip(kind: Kind, body: dict) -> dict:
    gw_key = new_key()
    env = decode(encode(Envelope(kind, "ep-gw", body), gw_key, compress=True), gw_key)
    return env.body


def test_body_keeps_order_and_lists_each_device_once() -> None:
    a1, b1, a2 = beat("ep-a", KA), beat("ep-b", KB), beat("ep-a", KA, running=1)
    body = site_body([("ep-a", a1), ("ep-b", b1), ("ep-a", a2)], seq=7, rows={"ep-c": [1, 2, 1, 0, 0, 0, 0, 3], "ep-a": [0] * 8})
    assert body["d"] == ["ep-a", "ep-b", "ep-c"] and body["n"] == 7
    got = roundtrip(Kind.SITE_UP, body)
    assert inner_frames(got) == [("ep-a", a1), ("ep-b", b1), ("ep-a", a2)]
    rows = dict(summary_rows(got))
    assert rows["ep-c"] == {"lan": 1, "epoch": 2, "capacity": 1, "running": 0, "queued": 0, "stored": 0, "outbox": 0, "want": 3}
    assert rows["ep-a"]["lan"] == 0 and summary_rows(roundtrip(Kind.SITE_UP, site_body([]))) == []
    # each inner frame is still exactly its signer's: it verifies with the device's key, not the gateway's
    assert decode(inner_frames(got)[1][1], KB).body == {"want": 1}


def test_compression_pays_on_many_small_frames() -> None:
    frames = [(f"ep-{i:012d}", beat(f"ep-{i:012d}", KA, running=i % 2)) for i in range(50)]
    raw = sum(len(f) for _, f in frames)
    gw_key = new_key()
    out = encode(Envelope(Kind.SITE_UP, "ep-gw", site_body(frames)), gw_key, compress=True)
    assert len(out) < raw  # MACs do not compress; headers and bodies do


@pytest.mark.parametrize("body,field", [
    ({"f": []}, "d must be"),
    ({"d": [], "f": {}}, "f must be"),
    ({"d": ["ep-a"], "f": [[1, b"x"]]}, "f[0]"),
    ({"d": ["ep-a"], "f": [[0, "not bytes"]]}, "f[0]"),
    ({"d": ["ep-a"], "f": [[0, b"x", 3]]}, "f[0]"),
    ({"d": ["ep-a"], "f": [[True, b"x"]]}, "f[0]"),
    ({"d": [""], "f": []}, "d[0]: a device id must be"),
    ({"d": ["ep-\u00e9"], "f": []}, "d[0]: a device id must be"),
    ({"d": ["ep-a"] * (SITE_MAX_FRAMES + 1), "f": []}, "d must be"),
    ({"d": ["ep-a"], "f": [], "n": -1}, "n must be"),
    ({"d": ["ep-a"], "f": [], "b": -1}, "b must be"),
    ({"d": ["ep-a"], "f": [], "b": "3"}, "b must be"),
    ({"d": ["ep-a"], "f": [], "s": []}, "s must be"),
    ({"d": ["ep-a"], "f": [], "s": {"l": [[1, 1, 0, 1, 0, 0, 0, 0, 0]]}}, "s.l[0]"),
    ({"d": ["ep-a"], "f": [], "s": {"l": [[0, 1, 0, 1, 0, 0, 0, 0]]}}, "s.l[0]"),
    ({"d": ["ep-a"], "f": [], "s": {"l": [[0, 1, 0, 1, 0, 0, 0, 0, -1]]}}, "s.l[0]"),
    ({"d": ["ep-a"], "f": [], "s": {"l": [[0, 1, 0, 1, 0, 0, 0, 0, 1.5]]}}, "s.l[0]"),
    ({"d": ["ep-a"], "f": [], "s": {"l": {}}}, "s.l must be"),
])
def test_malformed_bodies_are_one_clear_error(body: dict, field: str) -> None:
    for kind in (Kind.SITE_UP, Kind.SITE_DOWN):
        with pytest.raises(BadFrame, match=field.replace("[", r"\[").replace("]", r"\]")):
            validate_body(kind, body)


def test_split_refuses_foreign_devices_and_mislabelled_frames() -> None:
    mine, other = beat("ep-a", KA), beat("ep-x", KB)
    body = site_body([("ep-a", mine), ("ep-x", other), ("ep-a", other), ("ep-a", b"junk")])
    got = list(split_site_up(body, {"ep-a"}))
    assert got[0] == ("ep-a", mine)
    assert got[1][0] == "ep-x" and isinstance(got[1][1], BadFrame) and "not a device of this gateway" in str(got[1][1])
    assert isinstance(got[2][1], BadFrame) and "names ep-x" in str(got[2][1])
    assert isinstance(got[3][1], BadFrame)


def test_a_flipped_byte_in_an_inner_frame_fails_its_own_mac() -> None:
    inner = bytearray(beat("ep-a", KA, running=3))
    inner[-1] ^= 1
    body = roundtrip(Kind.SITE_UP, site_body([("ep-a", bytes(inner))]))
    (dev, frame), = list(split_site_up(body, {"ep-a"}))
    with pytest.raises(BadSignature):
        decode(frame, KA)


def test_batch_says_when_it_is_full() -> None:
    b = SiteBatch()
    assert not b.add("ep-a", b"x" * 100)
    assert b.add("ep-a", b"y" * SITE_FLUSH_BYTES)
    assert len(b) == 2 and b.nbytes == 100 + SITE_FLUSH_BYTES
    assert [d for d, _ in b.take()] == ["ep-a", "ep-a"] and len(b) == 0 and b.nbytes == 0


def test_a_site_down_carries_its_floor() -> None:
    body = roundtrip(Kind.SITE_DOWN, site_body([], seq=9, epoch="abcd", floor=4))
    assert body["n"] == 9 and body["b"] == 4 and settled_below(body) == 4
    assert settled_below(roundtrip(Kind.SITE_DOWN, site_body([], seq=1))) is None


def test_a_batch_that_cannot_be_sent_hands_its_tasks_back_at_once() -> None:
    """The hub's site_down link: a dropped batch's leased-ahead tasks go to on_lost (back to the
    queue), and the next batch's floor steps over it, so the gateway's "stored up to" goes on."""
    import asyncio

    from cloud_hub.site_frames import SiteDownLink
    from mesh_agent.transport import LinkError

    class Uplink:
        name = "mqtt"

        def __init__(self) -> None:
            self.up, self.sent = False, []

        async def send(self, endpoint_id: str, frame: bytes) -> None:
            if not self.up:
                raise LinkError("uplink down")
            self.sent.append(frame)

    signed: list[tuple[int, int]] = []

    def sign(frames: list, seq: int, epoch: str, floor: int) -> bytes:
        signed.append((seq, floor))
        return b"x" * 10 * len(frames)

    async def run() -> list[str]:
        lost: list[str] = []

        async def on_lost(ids: list[str]) -> None:
            lost.extend(ids)

        base = Uplink()
        link = SiteDownLink("ep-gw", base, sign, on_lost=on_lost)  # type: ignore[arg-type]
        await link.send("ep-a", b"t1", ["task-1"])
        with pytest.raises(LinkError):
            await link.flush()
        base.up = True
        await link.send("ep-a", b"t2", ["task-2"])
        assert link.inflight_bytes == 2
        await link.flush()
        assert link.inflight_bytes == 10 and link.pending.ids() == ["task-2"]
        return lost

    assert asyncio.run(run()) == ["task-1"]
    assert signed == [(1, 1), (2, 2)]  # batch 1 was given up: batch 2 says every batch below 2 is settled


def test_a_stored_up_to_beyond_what_was_sent_confirms_nothing() -> None:
    """A gateway (or a thief with its key) claiming a batch number the hub has not sent yet is lying:
    nothing is confirmed by it, so no later lease is pre-confirmed either."""
    import asyncio

    from cloud_hub.site_frames import SiteDownLink

    class Uplink:
        name = "mqtt"

        async def send(self, endpoint_id: str, frame: bytes) -> None:
            return None

    async def run() -> None:
        link = SiteDownLink("ep-gw", Uplink(), lambda frames, seq, epoch, floor: b"x")  # type: ignore[arg-type]
        await link.send("ep-a", b"t0", ["task-0"])
        await link.flush()
        assert link.confirmed_upto(link.epoch, 2**31 - 1) == ([], [])
        assert link.confirmed_upto("other", 1) == ([], [])
        ids, _ = link.confirmed_upto(link.epoch, 1)
        assert ids == ["task-0"]

    asyncio.run(run())
