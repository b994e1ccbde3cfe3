"""fl.compression: lossy update codecs over fl.wire, error feedback, the device's residual store,
and the driver refusing malformed compressed updates."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fl.compression import (
    FP16,
    Q8,
    Compression,
    CompressionError,
    ResidualStore,
    TopK,
    decode_update,
    encode_update,
    from_spec,
    parse,
)
from fl.wire import decode_weights, encode_weights


def _model(seed: int = 0):
    rng = np.random.default_rng(seed)
    base = [rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32), np.array(5, np.int64)]
    new = [base[0] + 0.01 * rng.normal(size=(16, 8)).astype(np.float32), base[1] + 0.01 * rng.normal(size=8).astype(np.float32),
           np.array(6, np.int64)]
    return base, new


def _delta(a, b):
    return np.concatenate([(np.asarray(x, np.float64) - np.asarray(y, np.float64)).ravel() for x, y in zip(a, b) if x.dtype.kind == "f"])


def test_parse_strings_objects_and_specs():
    assert parse(None) is None and parse("none") is None
    assert parse("fp16") == Compression(None, FP16())
    assert parse("q8") == Compression(None, Q8())
    assert parse("topk:0.01") == Compression(TopK(0.01), None)
    assert parse("topk:0.25+q8") == TopK(0.25) + Q8() == Compression(TopK(0.25), Q8())
    assert parse("TopK:0.1 + FP16").describe() == "topk:0.1+fp16"
    assert not parse("topk:0.1:noef").error_feedback and parse("topk:0.1").error_feedback
    for c in ("fp16", "q8", "topk:0.01", "topk:0.05+q8", "topk:0.1:noef+fp16", "q8:64"):
        comp = parse(c)
        assert from_spec(comp.spec()) == comp and parse(comp.spec()) == comp and parse(comp.describe()) == comp
    for bad in ("zip", "q8+topk:0.1", "topk:0", "topk:2", "topk", "fp16+q8", "topk:0.1:maybe"):
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(TypeError):
        parse(3)
    with pytest.raises(CompressionError):
        from_spec({"v": 1, "topk": 0.1, "evil": 1})


@pytest.mark.parametrize("spec", ["fp16", "q8", "topk:0.3", "topk:0.3+q8", "topk:0.05+fp16", "topk:1.0"])
def test_round_trip_keeps_shapes_dtypes_and_integer_tensors(spec):
    base, new = _model()
    comp = parse(spec)
    blob, enc, res = encode_update(new, base, comp, seed=3)
    out = decode_update(blob, enc, base, expected=comp)
    assert [(a.shape, a.dtype) for a in out] == [(a.shape, a.dtype) for a in new]
    assert out[2] == 6  # non-float tensors travel as they are
    sent = _delta(out, base)
    if comp.error_feedback:  # what was sent plus what stays on the device is the whole delta
        np.testing.assert_allclose(sent + res, _delta(new, base), atol=1e-6)
    if spec == "fp16":
        np.testing.assert_allclose(sent, _delta(new, base), rtol=1e-3, atol=1e-6)
    if spec == "topk:0.3":  # exactly the largest 30 % (of 136 float values: 41)
        d = _delta(new, base)
        keep = np.argsort(-np.abs(d))[:41]
        np.testing.assert_allclose(sent[keep], d[keep], rtol=1e-6)
        assert np.count_nonzero(sent) == 41 and enc["k"] == 41


def test_q8_is_unbiased_and_within_one_step():
    base = [np.zeros(1000, np.float32)]
    new = [np.linspace(-1, 1, 1000).astype(np.float32)]
    comp = parse("q8")
    outs = []
    for seed in range(200):
        blob, enc, _ = encode_update(new, base, comp, seed=seed)
        outs.append(decode_update(blob, enc, base)[0].astype(np.float64))
    outs = np.stack(outs)
    step = 2.0 / 255  # block range / 255 (the first block spans about 0.51, so steps there are smaller)
    assert np.all(np.abs(outs - new[0]) <= step + 1e-6)
    np.testing.assert_allclose(outs.mean(0), new[0], atol=step / 5)  # 200 draws: mean within step/5


def test_error_feedback_sends_what_was_left_later():
    base = [np.zeros(10, np.float32)]
    new = [np.arange(1, 11, dtype=np.float32)]  # delta 1..10
    comp = parse("topk:0.2")  # 2 values per round
    blob, enc, res = encode_update(new, base, comp)
    assert set(np.flatnonzero(decode_update(blob, enc, base)[0])) == {8, 9}
    # next round, no new movement: the residual alone is what is sent, the largest first
    blob2, enc2, res2 = encode_update(base, base, comp, residual=res)
    assert set(np.flatnonzero(decode_update(blob2, enc2, base)[0])) == {6, 7}
    assert res2[6] == 0 and res2[5] == 6
    # without error feedback nothing is carried
    _, _, none = encode_update(new, base, parse("topk:0.2:noef"))
    assert none is None


def test_compressed_sizes_against_the_lossless_wire():
    rng = np.random.default_rng(1)
    base = [(0.1 * rng.normal(size=(64, 64))).astype(np.float32), np.zeros(64, np.float32)]
    new = [b + (0.01 * rng.normal(size=b.shape)).astype(np.float32) for b in base]
    full = len(encode_weights(new))
    size = {s: len(encode_update(new, base, parse(s))[0]) for s in ("fp16", "q8", "topk:0.25+q8", "topk:0.01")}
    assert size["fp16"] < full * 0.6 and size["q8"] < full * 0.35
    assert size["topk:0.25+q8"] < full / 8 and size["topk:0.01"] < full / 40


def _tamper(blob, fn):
    arrays = decode_weights(blob)
    return encode_weights(fn(arrays))


def test_malformed_compressed_updates_are_refused():
    base, new = _model()
    comp = parse("topk:0.05+q8")  # 7 of 136 values: gaps, not a bitmap
    blob, enc, _ = encode_update(new, base, comp, seed=1)
    assert enc["index"] == "gaps"
    bad = {
        "other codec than asked": (blob, enc, parse("topk:0.05+fp16"), "asked for"),
        "wrong n": (blob, {**enc, "n": 99}, None, "float values"),
        "k too big": (blob, {**enc, "k": 1000}, None, "value count"),
        "not a blob": (b"junk", enc, None, "bad magic"),
        "index out of range": (_tamper(blob, lambda a: a[:3] + [np.array([0, 1, 1, 1, 1, 1, 200], np.uint8)] + a[4:]), enc, None, "out of range"),
        "index repeated": (_tamper(blob, lambda a: a[:3] + [np.array([0, 1, 0, 1, 1, 1, 1], np.uint8)] + a[4:]), enc, None, "strictly increasing"),
        "signed indices": (_tamper(blob, lambda a: a[:3] + [a[3].astype(np.int16)] + a[4:]), enc, None, "unsigned"),
        "codes not bytes": (_tamper(blob, lambda a: [a[0].astype(np.uint16)] + a[1:]), enc, None, "uint8"),
        "missing array": (_tamper(blob, lambda a: a[:2]), enc, None, "missing"),
        "extra array": (_tamper(blob, lambda a: a + [np.zeros(3, np.int64)]), enc, None, "more than the model"),
        "nan scale": (_tamper(blob, lambda a: [a[0], a[1], np.array([np.nan], np.float32)] + a[3:]), enc, None, "non-finite"),
        "no spec": (blob, {"n": 136}, None, "not a compression spec"),
    }
    for name, (b, e, expected, text) in bad.items():
        with pytest.raises(CompressionError, match=text):
            decode_update(b, e, base, expected=expected)
        assert name
    dense = parse("topk:0.5")  # 68 of 136: the bitmap (17 bytes) is smaller than 68 gaps
    blob, enc, _ = encode_update(new, base, dense)
    assert enc["index"] == "bitmap"
    flip = _tamper(blob, lambda a: [a[0], np.bitwise_or(a[1], np.uint8(0xFF))] + a[2:])
    with pytest.raises(CompressionError, match="marks"):
        decode_update(flip, enc, base)


def test_driver_decodes_compressed_updates_and_refuses_without_a_base():
    from fl.drivers import to_update

    base, new = _model()
    comp = parse("topk:0.3+q8")
    blob, enc, _ = encode_update(new, base, comp)
    value = {"v": 1, "kind": "update", "client_id": "ep-1", "weights": blob, "encoding": enc, "num_samples": 3, "base_version": 4}
    upd, why, info = to_update("ep-1", value, 4, base, comp)
    assert why is None and upd.base_version == 4 and info["bytes_up"] == len(blob) and "weights" not in info
    upd, why, _ = to_update("ep-1", value, 4, None, comp)
    assert upd is None and "no longer holds" in why
    upd, why, _ = to_update("ep-1", {**value, "weights": b"FLW1x"}, 4, base, comp)
    assert upd is None and "undecodable compressed update" in why


def test_residual_store_survives_a_new_process_and_reruns_use_the_same_input(tmp_path: Path):
    a = ResidualStore(tmp_path / "fl-state")
    assert a.load("run", "ep-1", 1) == (None, {"store": "file", "from_round": None})
    r1 = np.arange(4, dtype=np.float32)
    a.save("run", "ep-1", 1, None, r1)
    b = ResidualStore(tmp_path / "fl-state")  # another worker, after a reboot
    got, info = b.load("run", "ep-1", 2)
    assert np.array_equal(got, r1) and info == {"store": "file", "from_round": 1}
    r2 = r1 * 2
    b.save("run", "ep-1", 2, got, r2)
    again, info = b.load("run", "ep-1", 2)  # round 2 runs again (its result never left): same input
    assert np.array_equal(again, r1) and info["from_round"] == "rerun"
    late, info = b.load("run", "ep-1", 1)  # a late task of round 1: no residual, and it must not save
    assert late is None and info.get("stale")
    assert b.load("run", "ep-2", 3)[0] is None and b.load("other-run", "ep-1", 3)[0] is None
    files = list((tmp_path / "fl-state").iterdir())
    assert len(files) == 1 and files[0].name.startswith("ef-") and (files[0].stat().st_mode & 0o777) == 0o600
    files[0].write_bytes(b"FLEF1garbage")  # a torn or corrupted file counts as no residual
    assert b.load("run", "ep-1", 3) == (None, {"store": "file", "from_round": None})
    # memory store outside an agent
    m = ResidualStore(None)
    m.save("run-m", "ep-1", 1, None, r1)
    assert np.array_equal(m.load("run-m", "ep-1", 2)[0], r1) and m.kind == "memory"


def test_client_app_compresses_when_the_task_asks_and_keeps_its_residual(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from fl.client import FunctionClientApp
    from fl.drivers import to_update

    monkeypatch.setenv("MESH_ENDPOINT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("MESH_ENDPOINT_ID", raising=False)

    class App(FunctionClientApp):
        loads_data = False

    app = App(lambda w, data, cfg: ([a + 0.5 * (i + 1) for i, a in enumerate(w)], 7, {}))
    base = [np.zeros((4, 4), np.float32), np.zeros(4, np.float32)]
    comp = parse("topk:0.25")
    task = {"v": 1, "kind": "train", "run_id": "flr-c", "round": 1, "client_id": "ep-1", "base_version": 0,
            "weights": encode_weights(base), "dataset": "d", "config": {}, "uplink": comp.spec()}
    out = app(task)
    assert out["encoding"]["k"] == 5 and out["encoding"]["ef"] == {"store": "file", "from_round": None}
    upd, why, _ = to_update("ep-1", out, 0, base, comp)
    assert why is None and np.count_nonzero(upd.weights[0]) + np.count_nonzero(upd.weights[1]) == 5
    assert len(list((tmp_path / "fl-state").glob("ef-*.bin"))) == 1
    out2 = app({**task, "round": 2})
    assert out2["encoding"]["ef"]["from_round"] == 1
    plain = app({k: v for k, v in task.items() if k != "uplink"})
    assert "encoding" not in plain and len(decode_weights(plain["weights"])) == 2
    assert not any(p.name.startswith(".ef-") for p in (tmp_path / "fl-state").iterdir())  # no temporary file left
    assert os.environ["MESH_ENDPOINT_DATA_DIR"] == str(tmp_path)
