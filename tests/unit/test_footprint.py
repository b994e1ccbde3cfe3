"""Small on small devices, frugal on metered links: on-demand workers, compressed bodies, profiles.

Real worker processes and real frames; no timing assertions (bench/ measures the figures)."""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path

import msgpack
import pytest

from mesh_agent.config import AgentConfig
from mesh_agent.engine import EngineResult, EngineTask, LocalEngine
from mesh_agent.profile import resolve
from mesh_agent.protocol import (
    BadFrame,
    Envelope,
    Kind,
    decode,
    encode,
    serialize,
    serialize_function,
)
from mesh_agent.protocol.envelope import COMPRESS_MIN_BYTES

KEY = bytes(range(32))
EP = "ep-0123456789ab"


def _pid() -> int:
    import os

    return os.getpid()


async def _until(pred, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


# ------------------------------------------------------------------ workers on demand
def test_workers_start_on_demand_are_reaped_and_restart_without_losing_a_task() -> None:
    async def main() -> None:
        got: list[EngineResult] = []
        eng = LocalEngine(got.extend, workers=2, idle_s=0.3)
        await eng.start()
        body = serialize_function(_pid)
        try:
            assert eng.workers == 0 and eng.capacity == 2  # nothing runs before the first task
            eng.submit([EngineTask(f"a{i}", "f", body, serialize([[], {}])) for i in range(4)])
            await _until(lambda: len(got) == 4)
            first = {r.worker_pid for r in got}
            assert all(r.ok for r in got) and first and eng.stats["workers_spawned"] <= 2
            await _until(lambda: eng.workers == 0)  # idle past idle_s: all reaped
            assert eng.stats["workers_reaped"] == eng.stats["workers_spawned"]
            # Tasks arriving while workers are being reaped or after: each runs exactly once.
            for i in range(6):
                eng.submit([EngineTask(f"b{i}", "f", body, serialize([[], {}]))])
                await asyncio.sleep(0.1 * (i % 4))  # around the reaper's deadline
            await _until(lambda: len(got) == 10)
            ids = [r.task_id for r in got]
            assert sorted(ids) == sorted(set(ids)) and {f"b{i}" for i in range(6)} <= set(ids)
            assert eng.stats["worker_deaths"] == 0 and eng.stats["workers_spawned"] > len(first)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_warm_pool_without_idle_s_is_unchanged() -> None:
    async def main() -> None:
        eng = LocalEngine(lambda r: None, workers=2)
        await eng.start()
        try:
            assert eng.workers == 2 and len(eng.worker_pids) == 2 and not eng.on_demand
        finally:
            await eng.stop()
    asyncio.run(main())


def test_workers_are_not_multiprocessing_children() -> None:
    """No resource tracker: workers are plain interpreters started by subprocess."""
    async def main() -> None:
        import psutil

        before = {c.pid for c in psutil.Process().children(recursive=True)}  # other tests' meshes (session fixtures)
        eng = LocalEngine(lambda r: None, workers=1)
        await eng.start()
        try:
            cmds = []
            for k in psutil.Process().children(recursive=True):
                if k.pid in before:
                    continue
                try:
                    cmds.append(" ".join(k.cmdline()))
                except psutil.Error:  # gone, or a zombie, meanwhile
                    continue
            assert not any("resource_tracker" in c for c in cmds), cmds
            assert any("mesh_agent.engine._worker" in c for c in cmds), cmds
        finally:
            await eng.stop()
    asyncio.run(main())


# ------------------------------------------------------------------ compression
def test_large_body_is_compressed_and_round_trips() -> None:
    body = {"results": [{"id": "a" * 32, "ok": True, "data": b"json\n" + b"1" * 5000, "started": 1.0, "finished": 2.0, "pid": 1}]}
    env = Envelope(Kind.RESULTS, EP, body, ts=1000.0)
    plain = encode(env, KEY)
    packed = encode(env, KEY, compress=True)
    assert len(packed) < len(plain) // 10
    kind_at = 4 + len(EP)
    assert packed[kind_at] == 0x80 | 6 and plain[kind_at] == 6
    assert decode(packed, KEY, check_fresh=False).body == body


def test_small_body_is_never_compressed() -> None:
    env = Envelope(Kind.FETCH, EP, {"want": 12}, ts=1000.0)
    assert encode(env, KEY, compress=True) == encode(env, KEY)
    small = Envelope(Kind.ACK, EP, {"ids": ["a" * 32] * 20}, ts=1000.0)  # compressible, but under the threshold
    assert len(msgpack.packb(small.body)) <= COMPRESS_MIN_BYTES
    assert encode(small, KEY, compress=True) == encode(small, KEY)


def test_incompressible_body_goes_plain() -> None:
    env = Envelope(Kind.RESULTS, EP, {"results": [{"id": "a" * 32, "ok": True, "data": os.urandom(4000), "started": 1.0,
                                                    "finished": 2.0, "pid": 1}]}, ts=1000.0)
    frame = encode(env, KEY, compress=True)
    assert frame[4 + len(EP)] == 6


def _signed_compressed(payload: bytes) -> bytes:
    """A frame flagged compressed whose (signed) body is ``payload``, built from docs/protocol.md."""
    import hashlib
    import hmac
    import struct

    ep, mid = EP.encode(), b"m" * 24
    header = b"CM" + bytes([2, len(ep)]) + ep + bytes([0x80 | 6, len(mid)]) + mid + struct.pack(">dd", 1000.0, 1120.0)
    return header + hmac.new(KEY, header + payload, hashlib.sha256).digest() + payload


@pytest.mark.parametrize("payload, why", [
    (b"not zlib at all", "compressed body is corrupt"),
    (zlib.compress(msgpack.packb({"results": []}))[:-3], "truncated"),
    (zlib.compress(msgpack.packb({"results": []})) + b"junk", "trailing"),
])
def test_bad_compressed_body_is_refused_with_a_clear_error(payload: bytes, why: str) -> None:
    frame = _signed_compressed(payload)
    with pytest.raises(BadFrame, match=why):
        decode(frame, KEY, check_fresh=False)


def test_good_compressed_frame_built_from_the_docs_decodes() -> None:
    frame = _signed_compressed(zlib.compress(msgpack.packb({"results": []}, use_bin_type=True)))
    assert decode(frame, KEY, check_fresh=False).body == {"results": []}


def test_compressed_bomb_is_refused() -> None:
    bomb = zlib.compress(b"\0" * (65 * 2**20), 9)  # 65 MiB of zeros in ~65 KB
    with pytest.raises(BadFrame, match="inflates past"):
        decode(_signed_compressed(bomb), KEY, check_fresh=False)


# ------------------------------------------------------------------ profiles
def _cfg(tmp_path: Path, **kw: object) -> AgentConfig:
    base = {"endpoint_id": EP, "name": "pi", "hub_url": "http://hub", "data_dir": tmp_path, "credentials_file": tmp_path / "c.json"}
    return AgentConfig.model_validate({**base, **kw})


def test_profile_defaults(tmp_path: Path) -> None:
    lan = resolve(_cfg(tmp_path))  # loopback broker: the demo, tests
    assert (lan.name, lan.adaptive, lan.compress, lan.worker_idle_s) == ("lan", False, False, None)
    field = resolve(_cfg(tmp_path, mqtt={"host": "hub.example.org"}))
    assert (field.name, field.adaptive, field.compress, field.worker_idle_s) == ("metered", True, True, 60.0)
    zmq = resolve(_cfg(tmp_path, transport="zmq", mqtt={"host": "hub.example.org"}))
    assert zmq.name == "lan"
    explicit = resolve(_cfg(tmp_path, profile="metered", worker_idle_s=5, compress=False))
    assert (explicit.name, explicit.worker_idle_s, explicit.compress) == ("metered", 5, False)


def test_bad_profile_is_a_clear_config_error(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="profile"):
        _cfg(tmp_path, profile="cheap")
