"""Results from untrusted endpoints decode as data (issue 25 item 8, docs/security.md "What a
stolen device key can and cannot do"): the allow-list unpickler in mesh_agent/protocol/serialize.py
(``deserialize(..., trusted=False)``, ``load_data``) and the rebuild of remote exceptions by name
in cloud_hub/client/_results.py.

Each refusal must be a one-line ``SerializationError`` (``UntrustedResult`` at the SDK) and must
run nothing: the payloads that would run code leave a marker file if they ever do.
"""

from __future__ import annotations

import base64
import collections
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_hub.client._results import (
    RemoteExecutionError,
    RemoteTraceback,
    UntrustedResult,
    decode_row,
    to_exception,
)
from mesh_agent.engine import make_error
from mesh_agent.protocol import SerializationError, deserialize, serialize
from mesh_agent.protocol.serialize import load_data

try:
    from numpy._core.multiarray import _reconstruct  # numpy 2
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]


def untrusted(value: Any) -> Any:
    return deserialize(serialize(value), trusted=False)


def refused(blob: bytes) -> str:
    """The one-line reason ``blob`` (a pickle stream, no header) is refused."""
    with pytest.raises(SerializationError) as info:
        load_data(blob)
    msg = str(info.value)
    assert "\n" not in msg and msg
    return msg


# ---------------------------------------------------------------------------------- data decodes
NUMPY_VALUES = [
    np.arange(12.0).reshape(3, 4),
    np.arange(10)[::3],  # not contiguous: numpy pickles it through _reconstruct and BUILD
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    np.zeros((2, 0), np.float32),
    np.array([True, False]),
    np.array([1 + 2j, -3j], np.complex64),
    np.array(["a", "bcd"]),
    np.array([b"ab", b"c"]),
    np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
    np.array([1, 2], dtype="timedelta64[10ms]"),
    np.array(3.5),
    np.arange(4, dtype=">i4"),
]


@pytest.mark.parametrize("arr", NUMPY_VALUES, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_numpy_arrays_round_trip_untrusted(arr: np.ndarray) -> None:
    got = untrusted(arr)
    ref = pickle.loads(serialize(arr)[len(b"pickle\n"):])  # what numpy itself makes of it
    assert type(got) is np.ndarray and got.dtype == ref.dtype and got.shape == arr.shape
    assert np.array_equal(got, arr) and got.flags.f_contiguous == ref.flags.f_contiguous
    for protocol in (2, 3, 4):  # older writers (numpy 1, protocol < 5) go through _reconstruct
        old = load_data(pickle.dumps(arr, protocol=protocol))
        assert type(old) is np.ndarray and np.array_equal(old, arr) and old.dtype == pickle.loads(pickle.dumps(arr, protocol=protocol)).dtype


def test_numpy_scalars_dtypes_and_plain_containers_round_trip_untrusted() -> None:
    values = [np.float32(1.5), np.int64(-3), np.uint8(7), np.bool_(True), np.str_("xy"), np.complex128(1 - 1j),
              np.dtype(">f4"), np.dtype("U3"), 1 + 2j, {1, 2}, frozenset([b"x"]), bytearray(b"ab"),
              collections.OrderedDict(a=1, b=[2]), {"t": (1, 2.5), "b": b"\x00", "n": None}]
    for v in values:
        got = untrusted(v)
        assert got == v and type(got) is type(v), (v, got)
        for protocol in (2, 4):
            assert load_data(pickle.dumps(v, protocol=protocol)) == v


def test_fl_weights_shape_decodes_untrusted() -> None:
    """What an FL round function returns: weights as a list of arrays, counts and metrics."""
    weights = [np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32), np.zeros(3, np.float32), np.array(7, np.int64)]
    out = untrusted({"weights": weights, "n": 120, "metrics": {"loss": np.float64(0.25), "acc": 0.9}})
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(out["weights"], weights))
    assert out["metrics"]["loss"] == 0.25 and out["n"] == 120
    assert out["weights"][0].flags.writeable  # in-band protocol-5 buffers come back writable, as numpy's own


def test_decoding_never_changes_numpys_shared_dtypes() -> None:
    """numpy hands out one float64 dtype for the whole process; a pickle's BUILD must never reach it."""
    before = (np.dtype("f8").byteorder, np.dtype("f8").flags)
    load_data(pickle.dumps(np.dtype(">f8")))
    load_data(pickle.dumps(np.arange(3, dtype=">f8")[::2], protocol=2))
    assert (np.dtype("f8").byteorder, np.dtype("f8").flags) == before and np.dtype("f8").isnative


# ---------------------------------------------------------------------------------- code is refused
class Boom:
    """A ``__reduce__`` that would run a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class Popen:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (subprocess.Popen, (["touch", str(self.marker)],))


class Loot:
    def __init__(self, v: int) -> None:
        self.v = v


def test_code_and_objects_are_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cases = {
        "os.system": (Boom(marker), "system"),
        "subprocess.Popen": (Popen(marker), "subprocess.Popen"),
        "a class instance": (Loot(3), "Loot"),
        "a function": (os.getcwd, "getcwd"),
        "a nested __reduce__": ({"ok": [1, 2, Boom(marker)]}, "system"),
        "eval": (type("E", (), {"__reduce__": lambda self: (eval, ("1+1",))})(), "builtins.eval"),
        "getattr": (type("G", (), {"__reduce__": lambda self: (getattr, ("x", "upper"))})(), "builtins.getattr"),
    }
    for what, (value, named) in cases.items():
        with pytest.raises(SerializationError) as info:  # as the facade sends it (cloudpickle for local classes)
            untrusted(value)
        assert "only a trusted sender may send" in str(info.value) and "\n" not in str(info.value), what
        msg = refused(pickle.dumps(value, protocol=5))  # the same as a plain pickle stream
        assert named in msg and "only a trusted sender may send" in msg and "runs code" in msg, (what, msg)
    assert not marker.exists(), "a refused payload ran"


@pytest.mark.parametrize("arr", [np.array([1, "x", None], dtype=object), np.array([[{"a": 1}]], dtype=object),
                                 np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])], ids=["object", "object-2d", "structured"])
def test_numpy_object_and_structured_arrays_are_refused(arr: np.ndarray) -> None:
    with pytest.raises(SerializationError) as info:
        untrusted(arr)
    assert "numpy" in str(info.value) and "dtype" in str(info.value) and "\n" not in str(info.value)
    for protocol in (2, 4):
        assert "dtype" in refused(pickle.dumps(arr, protocol=protocol))


def test_numpy_subclasses_and_masked_arrays_are_refused() -> None:
    with pytest.warns(PendingDeprecationWarning):
        matrix = np.matrix([[1, 2]])
    assert "numpy.matrix" in refused(pickle.dumps(matrix))
    assert "numpy.ma" in refused(pickle.dumps(np.ma.array([1, 2], mask=[0, 1])))
    assert "builtins.range" in refused(pickle.dumps(range(3)))


class _Reduce:
    """Emits exactly the (callable, args, state) it is given: a crafted stream without hand-written opcodes."""

    def __init__(self, *rv: Any) -> None:
        self.rv = rv

    def __reduce__(self) -> Any:
        return self.rv


def test_crafted_numpy_streams_are_refused() -> None:
    """numpy's own unpickling trusts the dtype state it is given; ours must not."""
    # float64 whose state claims it holds object pointers (flags 63): numpy would believe it
    assert "state numpy never writes" in refused(pickle.dumps(_Reduce(np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 63))))
    # an object field hidden in a struct with flags 0, then raw bytes as its "pointers"
    hidden = _Reduce(np.dtype, ("V16", False, True), (3, "|", None, ("a", "b"), {"a": (np.dtype("O"), 0), "b": (np.dtype("f8"), 8)}, 16, 1, 0))
    assert "structured" in refused(pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), hidden, False, b"\x41" * 16))))
    # an array of float64 claiming the wrong amount of data
    f8 = _Reduce(np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 0))
    assert "not the 16 its shape needs" in refused(pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), f8, False, b"\0" * 8))))
    # _reconstruct with another class than ndarray, or a huge first shape
    assert "numpy.matrix" in refused(pickle.dumps(_Reduce(_reconstruct, (np.matrix, (0,), b"b"))))
    assert "malformed numpy array" in refused(pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (10**12,), b"b"))))
    # BUILD on something that is not a numpy object we made (a complex, an OrderedDict)
    assert "sets the state of a complex" in refused(pickle.dumps(_Reduce(complex, (1.0, 2.0), {"x": 1})))
    assert "sets the state of a OrderedDict" in refused(pickle.dumps(_Reduce(collections.OrderedDict, (), {"__class__": 1})))
    # a U dtype whose state says another size than its name
    assert "state numpy never writes" in refused(pickle.dumps(_Reduce(np.dtype, ("U2", False, True), (3, "<", None, None, None, 400, 4, 8))))
    # numpy.ndarray called directly, and a numpy scalar of object dtype
    assert "numpy.ndarray directly" in refused(pickle.dumps(_Reduce(np.ndarray, ((2,),))))
    assert "object dtype" in refused(pickle.dumps(_Reduce(np.dtype, ("O8", False, True))))


def test_corrupt_and_truncated_pickles_are_one_line_errors() -> None:
    good = pickle.dumps([np.arange(3), 1 + 1j], protocol=5)
    for blob in (good[: len(good) // 2], good[:-1], b"\x80\x05garbage", b""):
        msg = refused(blob)
        assert msg.startswith("cannot read pickle payload") or "only a trusted sender" in msg or "malformed" in msg


def test_code_payloads_are_refused_by_header() -> None:
    from mesh_agent.protocol import serialize_function

    with pytest.raises(SerializationError, match="it holds code sent by value .* which only a trusted sender may send"):
        deserialize(serialize_function(lambda: 1), trusted=False)
    with pytest.raises(SerializationError, match="it is a source payload, which only a trusted sender may send"):
        deserialize(b"source\nf\ndef f():\n    return 1\n", trusted=False)


def test_a_cloudpickle_header_holding_data_decodes() -> None:
    """An error dict holding a pickled exception of a __main__ or test-module class is sent by
    cloudpickle (its bytes mention the module); the dict itself is data and decodes."""
    blob = error_blob(CustomError("mine"))
    assert blob.startswith(b"cloudpickle\n")
    value = deserialize(blob, trusted=False)
    assert value["message"] == "mine" and isinstance(value["exception"], bytes)


# ---------------------------------------------------------------------------------- exceptions
def error_blob(exc: BaseException) -> bytes:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - the worker's make_error does the same
        return serialize(make_error(e))


class CustomError(Exception):
    pass


@pytest.mark.parametrize("exc", [ZeroDivisionError("division by zero"), ValueError("bad"), KeyError("k"), OSError("disk"),
                                 TimeoutError("slow")], ids=lambda e: type(e).__name__)
def test_builtin_exceptions_are_rebuilt_by_name_untrusted(exc: BaseException) -> None:
    value = deserialize(error_blob(exc), trusted=False)
    out = to_exception(value, trusted=False)
    assert type(out) is type(exc) and str(out) == value["message"] == str(exc)
    assert isinstance(out.__cause__, RemoteTraceback) and type(exc).__name__ in out.__cause__.tb


def test_other_exceptions_are_remote_execution_errors_untrusted() -> None:
    for exc in (CustomError("mine"), SystemExit(3), KeyboardInterrupt(), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")):
        out = to_exception(deserialize(error_blob(exc), trusted=False), trusted=False)
        assert type(out) is RemoteExecutionError and out.remote_type.endswith(type(exc).__name__)
    # a forged error dict naming a non-exception builtin, or something outside builtins
    for remote_type in ("builtins.eval", "builtins.BaseException", "builtins.GeneratorExit", "os.system", "builtins.", "builtins.__import__"):
        out = to_exception({"type": remote_type, "message": "x", "traceback": "", "exception": None}, trusted=False)
        assert type(out) is RemoteExecutionError


def test_trusted_exceptions_still_unpickle() -> None:
    out = to_exception(deserialize(error_blob(CustomError("mine"))), trusted=True)
    assert type(out) is CustomError and isinstance(out.__cause__, RemoteTraceback)


# ---------------------------------------------------------------------------------- decode_row
def row(value: Any, *, ok: bool = True, ep: str | None = "ep-1", own: bool = True, trusted: bool | None = False) -> dict[str, Any]:
    r = {"task_id": "t1", "ok": ok, "data": base64.b64encode(serialize(value)).decode(), "endpoint_id": ep, "own_endpoint": own}
    if trusted is not None:
        r["trusted"] = trusted
    return r


def test_decode_row_trusts_only_trusted_rows_and_listed_endpoints() -> None:
    assert decode_row(row(Loot(1), trusted=True))[1].v == 1
    assert decode_row(row(Loot(2), own=False), {"ep-1"})[1].v == 2
    assert decode_row(row(Loot(3), ep=None, trusted=None))[1].v == 3  # the hub made it
    with pytest.raises(UntrustedResult):
        decode_row(row(Loot(4), trusted=None))  # an older hub that does not say: untrusted
    ok, arr = decode_row(row(np.arange(3)))
    assert ok and np.array_equal(arr, np.arange(3))


def test_untrusted_result_names_the_setting_in_one_line() -> None:
    with pytest.raises(UntrustedResult) as info:
        decode_row(row(Loot(5)))
    msg = str(info.value)
    assert "\n" not in msg and "ep-1" in msg and "your endpoint, not marked trusted" in msg
    assert "set_endpoint_trusted('ep-1', True)" in msg and "trusted_endpoints=['ep-1']" in msg and "code sent by value" in msg
    with pytest.raises(UntrustedResult) as info:
        decode_row(row(Loot(6), own=False))
    msg = str(info.value)
    assert "\n" not in msg and "not yours" in msg and "trusted_endpoints=['ep-1']" in msg and "set_endpoint_trusted" not in msg
    ok, exc = decode_row(row(make_error(ZeroDivisionError("division by zero")), ok=False))
    assert not ok and type(exc) is ZeroDivisionError


# ---------------------------------------------------------------------------------- fuzz

_SEEDS = [pickle.dumps(v, protocol=p) for v in ([np.arange(6.0)[::2], np.float32(2), 1 + 1j, {"a": b"x"}],
                                               np.array(["ab"]), np.arange(4, dtype=">i2")) for p in (2, 5)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_SEEDS), st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=255),
       st.integers(min_value=0, max_value=10_000))
def test_mutated_pickles_only_decode_or_raise_serialization_error(seed: bytes, pos: int, byte: int, cut: int) -> None:
    """Single-byte changes and truncations of real data pickles (numpy ones included) either decode
    to data or fail with SerializationError; nothing else escapes, nothing of numpy's shared state changes."""
    blob = bytearray(seed)
    blob[pos % len(blob)] = byte
    blob = blob[: max(1, len(blob) - cut % 8)]
    try:
        load_data(bytes(blob))
    except SerializationError:
        pass
    assert np.dtype("f8").isnative and np.dtype("f8").flags == 0 and not np.dtype("f8").hasobject
