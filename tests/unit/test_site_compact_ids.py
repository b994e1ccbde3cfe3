"""Compact ids on the uplink (issue 29 item 5, mesh_agent/protocol/site.py, docs/sites.md).

Only what the gateway or the hub itself writes in a site batch may change: its device table. An
endpoint id of the known form ("ep-" + 12 lowercase hex digits) goes there as its 6 bytes, any
other id as its string; a reader decodes both, refuses anything else with one clear BadFrame, and
the inner frames stay byte for byte what their signers made. A sender writes binary ids only to
a peer that said it reads them (``bin: 1``): an older peer refuses such a batch as a whole.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cloud_hub.config import HubConfig
from cloud_hub.dispatcher import Dispatcher, _Session
from cloud_hub.site_frames import split_site_up
from mesh_agent.protocol import BadFrame, Envelope, Kind, decode, encode, new_key
from mesh_agent.protocol.bodies import validate_body
from mesh_agent.protocol.site import device_table, inner_frames, pack_id, site_body, summary_rows, unpack_id

KA, KB, KG = new_key(), new_key(), new_key()
A, B, ODD = "ep-0123456789ab", "ep-ba9876543210", "edge-gateway-7"


def beat(ep: str, key: bytes, **body: int) -> bytes:
    return encode(Envelope(Kind.HEARTBEAT, ep, dict(body) or {"want": 1}, ts=time.time()), key)


def roundtrip(kind: Kind, body: dict) -> dict:
    return decode(encode(Envelope(kind, "ep-000000000001", body), KG, compress=True), KG).body


def test_known_ids_pack_to_six_bytes_and_others_stay_strings() -> None:
    assert pack_id(A) == bytes.fromhex("0123456789ab") and unpack_id(pack_id(A)) == A
    for other in (ODD, "ep-0123456789AB", "ep-0123456789a", "ep-0123456789abc", "ep-0123456789ag", "0123456789ab"):
        assert pack_id(other) == other and unpack_id(other) == other


def test_a_binary_table_decodes_to_the_same_ids_and_leaves_inner_frames_alone() -> None:
    fa, fb, fo = beat(A, KA), beat(B, KB, running=1), beat(ODD, KA)
    frames = [(A, fa), (B, fb), (ODD, fo), (A, fa)]
    rows = {B: [1, 2, 1, 1, 0, 0, 0, 0]}
    body = roundtrip(Kind.SITE_UP, site_body(frames, rows=rows, binary_ids=True))
    assert body["d"] == [bytes.fromhex("0123456789ab"), bytes.fromhex("ba9876543210"), ODD]
    assert device_table(body) == [A, B, ODD]
    assert inner_frames(body) == frames  # byte for byte, each still verifies with its own key
    assert decode(inner_frames(body)[1][1], KB).body == {"running": 1}
    assert dict(summary_rows(body))[B]["epoch"] == 2
    assert [dev for dev, _ in split_site_up(body, {A, B, ODD})] == [A, B, ODD, A]
    # the same batch with string ids reads the same
    plain = roundtrip(Kind.SITE_UP, site_body(frames, rows=rows))
    assert plain["d"] == [A, B, ODD] and inner_frames(plain) == inner_frames(body)


def test_a_binary_table_is_smaller_on_the_wire() -> None:
    """A full liveness summary of ten idle devices, as the gateway sends it: small enough that the
    envelope does not compress it, so each of its ids saves its 8 bytes."""
    devices = [f"ep-{i:012x}" for i in range(10)]
    rows = {d: [1, 1, 1, 0, 0, 0, 0, 5] for d in devices}
    plain = encode(Envelope(Kind.SITE_UP, "ep-000000000001", site_body([], rows=rows)), KG, compress=True)
    compact = encode(Envelope(Kind.SITE_UP, "ep-000000000001", site_body([], rows=rows, binary_ids=True)), KG, compress=True)
    assert len(plain) - len(compact) == 8 * len(devices)


@pytest.mark.parametrize("entry,why", [
    (b"\x01\x23\x45\x67\x89", "6 bytes, got 5"),
    (b"\x01" * 7, "6 bytes, got 7"),
    (b"", "6 bytes, got 0"),
    (12, "6 bytes or a short ascii string"),
    (None, "6 bytes or a short ascii string"),
    ("", "6 bytes or a short ascii string"),
    ("ep-\u00e9", "6 bytes or a short ascii string"),
    ("e" * 256, "6 bytes or a short ascii string"),
    ([b"\x00" * 6], "6 bytes or a short ascii string"),
])
def test_a_malformed_table_entry_is_one_clear_error(entry: object, why: str) -> None:
    for kind in (Kind.SITE_UP, Kind.SITE_DOWN):
        with pytest.raises(BadFrame, match=rf"{kind.value} body: d\[1\]: .*{why}"):
            validate_body(kind, {"d": [A, entry], "f": [[0, beat(A, KA)]]})


def test_an_older_reader_refuses_a_binary_table_as_a_whole() -> None:
    """Why binary ids are negotiated: the check an older hub or gateway runs on ``d`` (all strings)."""
    body = site_body([(A, beat(A, KA))], binary_ids=True)
    assert not all(type(x) is str for x in body["d"])
    assert all(type(x) is str for x in site_body([(A, beat(A, KA))])["d"])


class _Link:
    name = "mqtt"

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        return None


@pytest.mark.parametrize("reads_bin", [False, True])
def test_the_hub_writes_binary_ids_only_to_a_gateway_that_reads_them(tmp_path: Path, reads_bin: bool) -> None:
    d = Dispatcher(HubConfig(db_path=tmp_path / "hub.sqlite3"), None, None)  # type: ignore[arg-type]
    gw = "ep-00000000000f"
    d._keys[gw] = KG
    s = d._sessions[gw] = _Session(gw, _Link(), time.time())  # type: ignore[arg-type]
    s.site_frames, s.site_bin = True, reads_bin
    inner = beat(A, KA)
    frame = d._site_signer(gw)([(A, inner)], 1, "0a0b0c0d", 1)
    body = decode(frame, KG).body
    assert body["d"] == ([bytes.fromhex("0123456789ab")] if reads_bin else [A])
    assert inner_frames(body) == [(A, inner)]
    del d._sessions[gw]  # no session: nothing known about the gateway, so strings, which any gateway reads
    assert decode(d._site_signer(gw)([(A, inner)], 2, "0a0b0c0d", 1), KG).body["d"] == [A]


def test_golden_binary_site_frames_name_the_same_devices_and_carry_the_same_inner_frames() -> None:
    """The golden vectors ``site_up_bin``/``site_down_bin`` (tests/unit/vectors/envelopes.json,
    docs/protocol.md): decoded, their tables name the devices of ``site_up``/``site_down``, and their
    inner frames are the very same bytes."""
    from tests.unit.test_protocol import KEY, VECTORS, frame_of

    vec = {v["name"]: decode(frame_of(v), KEY, now=v["ts"]).body for v in VECTORS}
    assert device_table(vec["site_up_bin"]) == ["ep-aaaaaaaaaaaa", "ep-bbbbbbbbbbbb", "pi-barn-3"]
    assert inner_frames(vec["site_up_bin"]) == inner_frames(vec["site_up"])
    assert dict(summary_rows(vec["site_up_bin"]))["pi-barn-3"]["lan"] == 0
    assert inner_frames(vec["site_down_bin"]) == inner_frames(vec["site_down"])
    assert [type(x) for x in vec["site_down_bin"]["d"]] == [bytes]


@pytest.mark.parametrize("hub_reads_bin", [False, True])
def test_the_gateway_writes_binary_ids_only_to_a_hub_that_reads_them(hub_reads_bin: bool) -> None:
    """Gateway._send_site_up: binary ids once the hub's welcome said ``site.bin: 1``, strings before."""
    import asyncio
    from types import SimpleNamespace

    from mesh_agent.gateway import Gateway

    sent: list[dict] = []

    async def send(kind: Kind, body: dict, *, compress: bool = False) -> None:
        sent.append(body)

    gw = SimpleNamespace(site_bin=hub_reads_bin, agent=SimpleNamespace(_send=send), stats={"site_up": 0}, _count_up=lambda f: None)
    asyncio.run(Gateway._send_site_up(gw, [(A, beat(A, KA))], rows={ODD: [1, 1, 1, 0, 0, 0, 0, 0]}))  # type: ignore[arg-type]
    assert sent[0]["d"] == ([bytes.fromhex("0123456789ab"), ODD] if hub_reads_bin else [A, ODD])
