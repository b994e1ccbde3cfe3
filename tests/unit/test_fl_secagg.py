"""Secure aggregation (fl.secagg): exact sums with dropouts, masks that hide the input, aborts."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fl.secagg import protocol as P
from fl.secagg import shamir
from fl.secagg.field import MODULUS, FieldCodec, QuantCodec, pack, prg, unpack
from fl.secagg.rounds import SecureClientApp, StateStore, secure_round
from fl.client import FunctionClientApp


def _run(ids, inputs, cfg, drop_after_mask=(), drop_after_share=(), unmask_missing=(), bits=32):
    """Drive the four steps in process; returns (server, total or exception, states)."""
    srv = P.ServerSession("run-1:3", cfg)
    srv.bits = bits
    st, adv = {}, []
    for c in ids:
        m, st[c] = P.client_advertise("run-1:3", c)
        adv.append(m)
    reqs = srv.share_requests(adv)
    sh = []
    for c in ids:
        if c in drop_after_share:
            continue
        m, st[c] = P.client_share(st[c], reqs[c])
        sh.append(m)
    mreq = srv.mask_requests(sh)
    ys = {}
    for c in mreq:
        y, st[c] = P.client_mask(st[c], inputs[c], mreq[c]["inbox"], mreq[c]["shared"], bits)
        ys[c] = y
        if c not in drop_after_mask:
            srv.add_masked(c, y)
    ureq = srv.unmask_requests()
    rev = [P.client_unmask(st[c], ureq[c]["survivors"], ureq[c]["dropped"]) for c in ureq if c not in unmask_missing]
    return srv, srv.finish(rev), ys


def test_six_clients_two_drop_after_masking_sum_is_exact():
    ids = [f"ep-{i}" for i in range(6)]
    rng = np.random.default_rng(1)
    codec = FieldCodec(clip=2.0, max_clients=6)
    floats = {c: rng.normal(0, 0.5, 777) for c in ids}
    enc = {c: codec.encode(floats[c], rng) for c in ids}
    _, (total, surv), _ = _run(ids, enc, P.SecAggConfig(threshold=4), drop_after_mask={"ep-1", "ep-4"})
    assert surv == ["ep-0", "ep-2", "ep-3", "ep-5"]
    want = np.zeros(777, dtype=np.uint64)
    for c in surv:
        want += enc[c]
    assert np.array_equal(total, (want % MODULUS).astype(np.uint32))  # exact in the field
    exact = sum(np.clip(floats[c], -2, 2) for c in surv)
    assert np.abs(codec.decode(total, 4) - exact).max() < 4 / codec.scale  # quantization only


def test_secagg_plus_sparse_graph_with_dropouts():
    ids = [f"c{i:02d}" for i in range(10)]
    rng = np.random.default_rng(2)
    enc = {c: rng.integers(0, MODULUS, 64, dtype=np.uint64).astype(np.uint32) for c in ids}
    cfg = P.SecAggConfig(threshold=3, neighbors=4)
    srv, (total, surv), _ = _run(ids, enc, cfg, drop_after_mask={"c03"}, drop_after_share={"c07"})
    assert all(len(v) < 9 for v in srv.graph.values())  # not everyone with everyone
    want = sum(enc[c].astype(np.uint64) for c in surv) % MODULUS
    assert np.array_equal(total, want.astype(np.uint32)) and "c03" not in surv and "c07" not in surv


def test_masked_update_is_uniform_and_independent_of_plaintext():
    ids = [f"ep-{i}" for i in range(4)]
    zeros = {c: np.zeros(20000, dtype=np.uint32) for c in ids}
    ramp = {c: (np.arange(20000, dtype=np.uint64) * 7919 % 1000).astype(np.uint32) for c in ids}
    _, _, ys0 = _run(ids, zeros, P.SecAggConfig(threshold=3))
    _, _, ys1 = _run(ids, ramp, P.SecAggConfig(threshold=3))
    a = np.frombuffer(ys0["ep-2"], "<u4") / MODULUS
    b = np.frombuffer(ys1["ep-2"], "<u4") / MODULUS
    assert stats.kstest(a, "uniform").pvalue > 1e-4          # a constant input looks uniform once masked
    assert stats.kstest(b, "uniform").pvalue > 1e-4
    assert stats.ks_2samp(a, b).pvalue > 1e-4                # two plaintexts: indistinguishable
    counts = np.bincount((np.frombuffer(ys0["ep-2"], "<u4") >> 24).astype(np.int64), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4
    assert abs(np.corrcoef(np.frombuffer(ys1["ep-2"], "<u4").astype(float), ramp["ep-2"].astype(float))[0, 1]) < 0.05


def test_too_many_dropouts_abort_not_a_wrong_sum():
    ids = [f"ep-{i}" for i in range(6)]
    enc = {c: np.ones(10, dtype=np.uint32) for c in ids}
    with pytest.raises(P.SecAggAbort, match="3 client\\(s\\) left after masked input, 4 needed; round skipped"):
        _run(ids, enc, P.SecAggConfig(threshold=4), drop_after_mask={"ep-0", "ep-1", "ep-2"})
    # enough masked inputs, but too few clients answer the unmasking step
    with pytest.raises(P.SecAggAbort, match="too few unmasking answers"):
        _run(ids, enc, P.SecAggConfig(threshold=4), drop_after_mask={"ep-0"}, unmask_missing={"ep-1", "ep-2"})


def test_client_refuses_inconsistent_server():
    ids = ["a", "b", "c"]
    srv = P.ServerSession("t", P.SecAggConfig(threshold=2))
    st, adv = {}, []
    for c in ids:
        m, st[c] = P.client_advertise("t", c)
        adv.append(m)
    reqs = srv.share_requests(adv)
    evil = {**reqs["a"], "keys": {**reqs["a"]["keys"], "a": reqs["b"]["keys"]["b"]}}
    with pytest.raises(P.SecAggError, match="other public keys"):
        P.client_share(st["a"], evil)
    sh = []
    for c in ids:
        m, st[c] = P.client_share(st[c], reqs[c])
        sh.append(m)
    mreq = srv.mask_requests(sh)
    y, st["a"] = P.client_mask(st["a"], np.zeros(4, np.uint32), mreq["a"]["inbox"], mreq["a"]["shared"])
    with pytest.raises(P.SecAggError, match="both as survivors and as dropped"):
        P.client_unmask(st["a"], ["a", "b"], ["b"])
    # a tampered ciphertext does not decrypt
    st["a"]["inbox"]["b"] = st["a"]["inbox"]["b"][:-1] + bytes([st["a"]["inbox"]["b"][-1] ^ 1])
    with pytest.raises(P.SecAggError, match="does not decrypt"):
        P.client_unmask(st["a"], ["a", "b"], ["c"])


def test_shamir_threshold_and_bad_input():
    secret = bytes(range(32))
    sh = shamir.split(secret, 5, 3)
    assert sorted(sh) == [1, 2, 3, 4, 5] and all(len(v) == 32 for v in sh.values())
    assert shamir.combine({x: sh[x] for x in (2, 4, 5)}, 3) == secret
    assert shamir.combine({x: sh[x] for x in (1, 3, 4, 5)}, 3) == secret
    # two shares of a 3-of-5 sharing: any secret is as likely (a wrong guess at the third share
    # rebuilds another secret, not this one)
    assert shamir.combine({1: sh[1], 2: sh[2], 3: bytes(32)}, 3) != secret
    with pytest.raises(shamir.ShamirError, match="2 share\\(s\\), 3 needed"):
        shamir.combine({1: sh[1], 2: sh[2]}, 3)
    with pytest.raises(shamir.ShamirError, match="32 bytes"):
        shamir.combine({1: sh[1], 2: sh[2], 3: sh[3][:16]}, 3)
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, 2, 3)
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(secret, 5, 1)
    with pytest.raises(ValueError, match="32 bytes"):
        shamir.split(secret[:16], 5, 3)
    assert shamir.positions(["c", "a", "b"]) == {"a": 1, "b": 2, "c": 3}
    with pytest.raises(ValueError, match="config|threshold"):
        P.SecAggConfig(threshold=1)


def test_prg_and_codec():
    assert np.array_equal(prg(b"k" * 32, 5), prg(b"k" * 32, 5)) and not np.array_equal(prg(b"k" * 32, 5), prg(b"j" * 32, 5))
    c = FieldCodec(clip=1.0, max_clients=3)
    rng = np.random.default_rng(0)
    x = np.array([-5.0, -1.0, -0.3, 0.0, 0.25, 1.0, 7.0])
    s = c.encode(x, rng) + c.encode(x, rng) + c.encode(x, rng)
    assert np.allclose(c.decode(s, 3), 3 * np.clip(x, -1, 1), atol=3 / c.scale)
    with pytest.raises(ValueError, match="at most 3"):
        c.decode(s, 4)


def _train(weights, data, config):
    return [w + 0.01 * (1 + int(config["seed"]) % 3) for w in weights], 10 + int(config["seed"]) % 5, {"loss": 0.5}


def _losing_answers(apps, dropped, seen=None):
    """secure_round's ``ask``: every client answers but those in ``dropped``, which train and mask
    and then lose their answer (dropped after masking); ``seen`` records who was asked at which stage."""

    def ask(stage, tasks):
        out = {}
        for c, t in tasks.items():
            if seen is not None:
                seen.append((stage, c))
            if stage == "train" and c in dropped:
                apps[c](t)
                continue
            out[c] = apps[c](t)
        return out

    return ask


def test_secure_round_through_client_apps_in_process(tmp_path):
    """The device app and the driver orchestration together (``ask`` calls the apps directly):
    6 clients, 2 never answer the train step, the new model equals plain averaging of the
    clipped deltas of the 4 survivors; key state is deleted after unmasking."""
    from fl.wire import encode_weights

    apps = {f"ep-{i}": SecureClientApp(FunctionClientApp(_train), state_dir=tmp_path / f"ep-{i}") for i in range(6)}
    for a in apps.values():
        a.inner.loads_data = False
    current = [np.zeros((3, 2)), np.ones(4)]
    dropped = {"ep-1", "ep-4"}
    seen: list[tuple[str, str]] = []
    ask = _losing_answers(apps, dropped, seen)

    def train_task(c):
        return {"round": 3, "weights": encode_weights(current), "dataset": "none", "config": {"seed": 0}}

    res = secure_round(ask, "run-x:3", sorted(apps), current, train_task, config=P.SecAggConfig(threshold=4),
                       clip_norm=10.0, weight_cap=1)
    assert res.reason is None and res.survivors == ["ep-0", "ep-2", "ep-3", "ep-5"]
    assert sorted(res.dropped_after_masking) == ["ep-1", "ep-4"]
    from fl.client import client_seed
    deltas = [0.01 * (1 + client_seed(0, 3, c) % 3) for c in res.survivors]
    assert np.allclose(res.weights[0], np.mean(deltas), atol=1e-4)
    assert np.allclose(res.weights[1], 1 + np.mean(deltas), atol=1e-4)
    for c in res.survivors:
        assert not list((tmp_path / c).glob("*.json"))  # keys gone after unmasking
    # the same with three lost: a clear abort, no model
    dropped.add("ep-5")
    res2 = secure_round(ask, "run-x:4", sorted(apps), current, train_task, config=P.SecAggConfig(threshold=4),
                        clip_norm=10.0, weight_cap=1)
    assert res2.weights is None and "round skipped" in res2.reason


def test_state_store_refuses_missing_state(tmp_path, monkeypatch):
    monkeypatch.delenv("MESH_ENDPOINT_DATA_DIR", raising=False)
    with pytest.raises(Exception, match="data directory"):
        StateStore()
    s = StateStore(tmp_path)
    with pytest.raises(P.SecAggError, match="no secure-aggregation state"):
        s.get("t", "me")
    s.put("t", "me", {"k": b"\x00\x01", "n": [1, {"x": b"y"}]})
    assert s.get("t", "me") == {"k": b"\x00\x01", "n": [1, {"x": b"y"}]}
    assert oct(next(tmp_path.glob("*.json")).stat().st_mode & 0o777) == "0o600"


# ---------------------------------------------------------------- compression and masking compose (issue 11)
def test_q8_secure_sum_is_the_sum_of_the_dequantized_updates_in_a_16_bit_field():
    ids = [f"ep-{i}" for i in range(6)]
    rng = np.random.default_rng(5)
    codec = QuantCodec(8, 0.05, max_clients=6)
    assert codec.field_bits == 16  # 6 x 255 < 2^16
    floats = {c: np.concatenate([rng.normal(0, 0.02, 1000), [rng.uniform(0.1, 1.0)]]) for c in ids}
    codes = {c: codec.encode(floats[c], rng) for c in ids}
    _, (total, surv), ys = _run(ids, codes, P.SecAggConfig(threshold=4), drop_after_mask={"ep-1", "ep-4"}, bits=16)
    assert surv == ["ep-0", "ep-2", "ep-3", "ep-5"]  # two dropouts after masking, recovered
    assert np.array_equal(total, sum(codes[c].astype(np.uint64) for c in surv).astype(np.uint32))  # never wraps
    want = sum(codec.dequantize(codes[c]) for c in surv)
    assert np.allclose(codec.decode(total, 4), want, rtol=0, atol=1e-12)
    # on the wire: 2 bytes a coordinate, against 4 for the 32-bit field of the same vector
    assert {len(y) for y in ys.values()} == {2 * 1001}
    f32 = FieldCodec(clip=0.2, max_clients=6)
    _, _, ys32 = _run(ids, {c: f32.encode(floats[c], rng) for c in ids}, P.SecAggConfig(threshold=4))
    assert {len(y) for y in ys32.values()} == {4 * 1001}
    # fp16's width: 16-bit codes, a 24-bit field, 3 bytes a coordinate; the sum just as exact
    c16 = QuantCodec(16, 0.05, max_clients=6)
    assert c16.field_bits == 24
    codes16 = {c: c16.encode(floats[c], rng) for c in ids}
    _, (t16, surv16), ys16 = _run(ids, codes16, P.SecAggConfig(threshold=4), drop_after_mask={"ep-0"}, bits=24)
    assert {len(y) for y in ys16.values()} == {3 * 1001}
    assert np.allclose(c16.decode(t16, 5), sum(c16.dequantize(codes16[c]) for c in surv16), rtol=0, atol=1e-12)


def test_shared_grid_rounding_is_unbiased_and_the_width_follows_the_client_count():
    codec = QuantCodec(8, 1.0, max_clients=3)
    x = np.array([-0.9991, -0.5, -0.00123, 0.0, 0.003, 0.3333, 0.77, 1.0, 0.37])  # last: the weight
    rng = np.random.default_rng(0)
    draws = np.stack([codec.dequantize(codec.encode(x, rng)) for _ in range(4000)])
    # a mean of 4000 draws, each within one step of x: 5 standard errors of step/2
    assert np.all(np.abs(draws[:, :-1].mean(0) - x[:-1]) < 5 * codec.step / 2 / np.sqrt(4000))
    assert abs(draws[:, -1].mean() - 0.37) < 5 * (1 / 255) / 2 / np.sqrt(4000)
    assert np.all(np.abs(draws[:, :-1] - x[:-1]) <= codec.step + 1e-12)  # one step at most, never more
    # past the range: clipped, as the 32-bit codec clips at its field_clip
    assert np.allclose(codec.dequantize(codec.encode(np.array([5.0, -5.0, 1.0]), rng)), [1.0, -1.0, 1.0])
    assert QuantCodec(8, 1.0, max_clients=257).field_bits == 16
    assert QuantCodec(8, 1.0, max_clients=258).field_bits == 24
    assert QuantCodec(16, 1.0, max_clients=256).field_bits == 24
    assert QuantCodec(16, 1.0, max_clients=257).field_bits == 32
    for kw, msg in [({"code_bits": 4, "range": 1.0}, "8- or 16-bit"), ({"code_bits": 8, "range": 0.0}, "positive finite"),
                    ({"code_bits": 8, "range": float("nan")}, "positive finite"),
                    ({"code_bits": 16, "range": 1.0, "max_clients": 70000}, "do not fit a 32-bit field")]:
        with pytest.raises(ValueError, match=msg):
            QuantCodec(**kw)
    with pytest.raises(ValueError, match="allows 1..3"):
        codec.decode(codec.encode(x, rng), 4)


def test_narrow_field_masks_look_uniform_and_bad_vectors_are_refused_without_a_trace():
    ids = [f"ep-{i}" for i in range(4)]
    zeros = {c: np.zeros(20000, dtype=np.uint32) for c in ids}
    _, _, ys = _run(ids, zeros, P.SecAggConfig(threshold=3), bits=16)
    a = unpack(ys["ep-2"], 16)
    assert a.max() < 1 << 16 and stats.kstest(a / 65536.0, "uniform").pvalue > 1e-4
    v = np.array([0, 1, 0xABCDEF, (1 << 24) - 1], dtype=np.uint32)
    assert np.array_equal(unpack(pack(v, 24), 24), v) and len(pack(v, 24)) == 12
    with pytest.raises(ValueError, match="whole number of 3-byte"):
        unpack(b"\x00" * 7, 24)
    with pytest.raises(ValueError, match="field width"):
        pack(v, 12)
    # an input outside the field, a masked vector of the wrong width: clear errors, state unchanged
    srv = P.ServerSession("t", P.SecAggConfig(threshold=2))
    srv.bits = 16
    st, adv = {}, []
    for c in ["a", "b"]:
        m, st[c] = P.client_advertise("t", c)
        adv.append(m)
    reqs = srv.share_requests(adv)
    sh = []
    for c in ["a", "b"]:
        m, st[c] = P.client_share(st[c], reqs[c])
        sh.append(m)
    mreq = srv.mask_requests(sh)
    with pytest.raises(P.SecAggError, match="does not lie in the 16-bit field"):
        P.client_mask(st["a"], np.array([1 << 16], np.uint32), mreq["a"]["inbox"], mreq["a"]["shared"], 16)
    assert st["a"]["stage"] == "shared"
    with pytest.raises(P.SecAggError, match="whole number of 2-byte"):
        srv.add_masked("a", b"\x00" * 5)
    assert srv.masked == {} and srv.dim is None


def _train_q(weights, data, config):
    return [w + 0.004 * (1 + int(config["seed"]) % 3) for w in weights], 10, {"loss": 0.5}


def test_secure_round_with_q8_through_client_apps(tmp_path):
    """The device app reads the train task's uplink spec (q8), quantizes on the driver's grid,
    masks in Z_{2^16}; 2 of 6 drop after masking; the new model is the mean of the survivors'
    dequantized deltas; the masked vectors are half the bytes of the 32-bit ones."""
    from fl.client import TaskError, client_seed
    from fl.compression import parse
    from fl.wire import encode_weights

    apps = {f"ep-{i}": SecureClientApp(FunctionClientApp(_train_q), state_dir=tmp_path / f"ep-{i}") for i in range(6)}
    for a in apps.values():
        a.inner.loads_data = False
    current = [np.zeros((30, 20)), np.ones(40)]
    uplink = {"spec": parse("q8").spec()}
    ask = _losing_answers(apps, {"ep-1", "ep-4"})

    def train_task(c):
        t = {"round": 3, "weights": encode_weights(current), "dataset": "none", "config": {"seed": 0}}
        if uplink["spec"] is not None:
            t["uplink"] = uplink["spec"]
        return t

    kw = dict(config=P.SecAggConfig(threshold=4), clip_norm=10.0, weight_cap=1, max_clients=6)
    res = secure_round(ask, "run-q:3", sorted(apps), current, train_task, quant_range=0.02, **kw)
    assert res.reason is None and res.survivors == ["ep-0", "ep-2", "ep-3", "ep-5"]
    assert res.field_bits == 16 and res.quant_range == 0.02
    assert set(res.bytes_up) == set(res.survivors) and set(res.bytes_up.values()) == {2 * (600 + 40 + 1)}
    assert set(res.bytes_down) == set(apps) and min(res.bytes_down.values()) > 0
    assert res.overhead_bytes["up"] > 0 and res.overhead_bytes["down"] > 0
    deltas = [0.004 * (1 + client_seed(0, 3, c) % 3) for c in res.survivors]
    step = QuantCodec(8, 0.02).step
    # one step of rounding per coordinate at most, averaged over 4 clients; unbiased on the whole
    assert np.abs(res.weights[0] - np.mean(deltas)).max() <= step
    assert abs(float(np.mean(res.weights[0])) - np.mean(deltas)) < step / 10
    assert np.abs(res.weights[1] - 1 - np.mean(deltas)).max() <= step
    # the same round in the 32-bit field (no compression): twice the bytes per masked vector
    uplink["spec"] = None
    res32 = secure_round(ask, "run-q:4", sorted(apps), current, train_task, **kw)
    assert res32.field_bits == 32 and set(res32.bytes_up.values()) == {4 * (600 + 40 + 1)}
    with pytest.raises(ValueError, match="quant_range needs train tasks with a q8 or fp16"):
        secure_round(ask, "run-q:5", sorted(apps), current, train_task, quant_range=0.02, **kw)
    # a sparse uplink cannot be masked: the device refuses it, before training
    uplink["spec"] = parse("topk:0.1").spec()
    with pytest.raises(TaskError, match="cannot send a sparse update"):
        from fl.secagg.rounds import quant_code_bits
        quant_code_bits(uplink["spec"])
