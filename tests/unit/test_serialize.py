"""The serializer facade (mesh_agent.protocol.serialize): method choice, round trips, headers, errors.

``vectors/serialize.json`` pins the exact bytes of the JSON method (deterministic: compact
separators, UTF-8, no ASCII escaping) and the values that must take the pickle path.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import pickle
from pathlib import Path
from typing import Any

import dill
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh_agent.engine import make_error
from mesh_agent.protocol import (
    SerializationError,
    deserialize,
    deserialize_function,
    function_id,
    method_of,
    serialize,
    serialize_function,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "serialize.json").read_text())


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (so 1 != 1.0, -0.0 != 0.0, tuple != list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


# ---------------------------------------------------------------------------------- json
@pytest.mark.parametrize("vec", VECTORS["json"], ids=lambda v: v["name"])
def test_json_golden_bytes(vec: dict[str, Any]) -> None:
    blob = bytes.fromhex(vec["blob"])
    assert serialize(vec["value"]) == blob
    assert blob.startswith(b"json\n")
    assert method_of(blob) == "json"
    assert same(deserialize(blob), vec["value"])


def test_json_is_compact_utf8_without_escaping() -> None:
    assert serialize({"a": [1, 2], "b": "\u00e9"}) == b'json\n{"a":[1,2],"b":"\xc3\xa9"}'
    assert serialize([[2, 3], {}]) == b"json\n[[2,3],{}]"


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -1, 2**63 - 1, 0.1, -0.0, 1e308, "", "x" * 1000, [], {}, [1, [2, [3]]], {"a": {"b": [None, 1.5]}}],
)
def test_json_round_trip(value: Any) -> None:
    blob = serialize(value)
    assert method_of(blob) == "json"
    assert same(deserialize(blob), value)


# ---------------------------------------------------------------------------------- pickle
@pytest.mark.parametrize("vec", VECTORS["pickle"], ids=lambda v: v["literal"])
def test_values_json_cannot_keep_go_to_pickle(vec: dict[str, Any]) -> None:
    value = ast.literal_eval(vec["literal"])
    blob = serialize(value)
    assert blob.startswith(bytes.fromhex(vec["header"])) and method_of(blob) == "pickle"
    assert same(deserialize(blob), value) or (isinstance(value, set) and deserialize(blob) == value)


@pytest.mark.parametrize(
    "value",
    [
        (1, 2, 3),
        ((1, "a"), {"k": (2,)}),  # the SDK's (args, kwargs) shape: always pickle, as the SDK sends a tuple
        b"\x00\xffraw",
        bytearray(b"ab"),
        {1: "int key"},
        {"nested": [(1, 2)]},
        2**64,
        1 + 2j,
        frozenset({1, 2}),
        float("inf"),
    ],
)
def test_pickle_round_trip(value: Any) -> None:
    blob = serialize(value)
    assert method_of(blob) == "pickle"
    assert same(deserialize(blob), value) or deserialize(blob) == value


def test_nan_goes_to_pickle() -> None:
    blob = serialize(float("nan"))
    assert method_of(blob) == "pickle" and math.isnan(deserialize(blob))


def test_numpy_round_trip() -> None:
    arrays = [np.arange(12, dtype=np.int16).reshape(3, 4), np.linspace(0, 1, 5, dtype=np.float32), np.array(["a", "bc"])]
    for a in arrays:
        blob = serialize(a)
        assert method_of(blob) == "pickle"
        back = deserialize(blob)
        assert back.dtype == a.dtype and back.shape == a.shape and np.array_equal(back, a)
    # numpy scalars subclass float/int but are not JSON-exact: they keep their type through pickle.
    for s in (np.float64(1.5), np.int64(7), np.bool_(True)):
        blob = serialize(s)
        assert method_of(blob) == "pickle" and type(deserialize(blob)) is type(s)


def test_pickle_is_protocol_5() -> None:
    blob = serialize((1,))
    assert blob[len(b"pickle\n") :][:2] == b"\x80\x05"


# ---------------------------------------------------------------------------------- dill
def _make_closure() -> Any:
    offset = 10

    def add_offset(x: int) -> int:
        return x + offset

    return add_offset


def test_lambda_and_closure_as_data_use_cloudpickle() -> None:
    for fn, arg, want in ((lambda x: x * 2, 4, 8), (_make_closure(), 1, 11)):
        blob = serialize(fn)
        assert method_of(blob) == "cloudpickle"
        assert deserialize(blob)(arg) == want


def test_local_class_instance_uses_cloudpickle() -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    blob = serialize(Point(3))
    assert method_of(blob) == "cloudpickle"
    assert deserialize(blob).x == 3


def test_serialize_function_uses_cloudpickle_by_value() -> None:
    for fn, arg, want in ((lambda x: x + 1, 1, 2), (_make_closure(), 5, 15), (math.sqrt, 9.0, 3.0)):
        blob = serialize_function(fn)
        assert method_of(blob) == "cloudpickle"
        assert deserialize_function(blob)(arg) == want


def test_dill_blobs_still_load_and_dill_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    import cloudpickle

    assert deserialize(b"dill\n" + dill.dumps(lambda x: x * 3, recurse=True))(2) == 6
    monkeypatch.setattr(cloudpickle, "dumps", lambda *a, **k: (_ for _ in ()).throw(TypeError("no")))
    blob = serialize_function(_make_closure())
    assert method_of(blob) == "dill" and deserialize_function(blob)(1) == 11


def test_unserializable_value_is_serialization_error() -> None:
    def gen() -> Any:
        yield 1

    with pytest.raises(SerializationError, match="generator"):
        serialize(gen())


# ---------------------------------------------------------------------------------- source fallback
def scale(x: float, factor: float = 2.0) -> float:
    """A module-level function: its source is available to inspect.getsource."""
    return x * factor


@pytest.fixture
def dill_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> bytes:
        raise TypeError("dill refuses this object")

    import cloudpickle

    monkeypatch.setattr(dill, "dumps", refuse)
    monkeypatch.setattr(cloudpickle, "dumps", refuse)


def test_source_fallback_when_dill_fails(dill_refuses: None) -> None:
    blob = serialize_function(scale)
    assert method_of(blob) == "source"
    assert blob.startswith(b"source\nscale\ndef scale(x: float, factor: float = 2.0) -> float:\n")
    fn = deserialize_function(blob)
    assert fn(3.0) == 6.0 and fn(3.0, factor=3.0) == 9.0


def test_source_fallback_dedents_nested_functions(dill_refuses: None) -> None:
    def inner(x: int) -> int:
        return x - 1

    blob = serialize_function(inner)
    assert blob.startswith(b"source\ninner\ndef inner(")
    assert deserialize_function(blob)(5) == 4


def test_source_without_source_is_serialization_error(dill_refuses: None) -> None:
    ns: dict[str, Any] = {}
    exec("def made_at_runtime(x):\n    return x\n", ns)  # noqa: S102 - no source file to read back
    with pytest.raises(SerializationError, match="made_at_runtime"):
        serialize_function(ns["made_at_runtime"])


def test_a_lambda_is_never_sent_as_source_text(dill_refuses: None) -> None:
    """A lambda's "source" is the whole line around it, which cannot be rebuilt on the endpoint:
    when the code serializers refuse it, the caller hears so at once, in the client."""
    f = lambda x: x  # noqa: E731
    with pytest.raises(SerializationError, match="cannot send function"):
        serialize_function(f)


def test_source_text_that_defines_nothing_fails_at_load_with_serialization_error() -> None:
    with pytest.raises(SerializationError, match="does not define"):
        deserialize_function(b"source\nf\ng = 1\n")


def test_source_blob_format_by_hand() -> None:
    blob = b"source\ntwice\ndef twice(v):\n    return 2 * v\n"
    assert method_of(blob) == "source"
    assert deserialize_function(blob)(21) == 42


def test_serialize_function_refuses_non_callables() -> None:
    with pytest.raises(SerializationError, match="callable"):
        serialize_function(42)  # type: ignore[arg-type]


def test_deserialize_function_refuses_data() -> None:
    with pytest.raises(SerializationError, match="not a callable"):
        deserialize_function(serialize([1, 2]))


# ---------------------------------------------------------------------------------- function id
def test_function_id_is_sha256_of_the_serialized_body() -> None:
    for vec in VECTORS["function_id"]:
        assert function_id(bytes.fromhex(vec["body"])) == vec["function_id"]
    body = serialize_function(scale)
    assert function_id(body) == hashlib.sha256(body).hexdigest()
    assert len(function_id(body)) == 64


def test_function_id_is_stable_for_the_same_body() -> None:
    closure = _make_closure()
    assert function_id(serialize_function(closure)) == function_id(serialize_function(closure))
    assert function_id(serialize_function(_make_closure())) == function_id(serialize_function(_make_closure()))
    assert function_id(serialize_function(scale)) == function_id(serialize_function(scale))
    assert function_id(serialize_function(scale)) != function_id(serialize_function(closure))


def test_function_id_covers_the_header() -> None:
    src = b"f\ndef f():\n    return 1\n"
    assert function_id(b"source\n" + src) != function_id(b"dill\n" + src)


# ---------------------------------------------------------------------------------- headers and errors
@pytest.mark.parametrize(
    ("blob", "method"),
    [(b"json\n1", "json"), (b"pickle\n", "pickle"), (b"cloudpickle\n", "cloudpickle"), (b"dill\n", "dill"), (b"source\n", "source"), (bytearray(b"json\n[]"), "json")],
)
def test_method_of(blob: bytes, method: str) -> None:
    assert method_of(blob) == method


@pytest.mark.parametrize("blob", [b"", b"json", b"JSON\n1", b" json\n1", b"msgpack\n\x90", b"pickle", b"\x80\x05K\x01.", b"yaml\na: 1"])
def test_unknown_header_is_serialization_error(blob: bytes) -> None:
    with pytest.raises(SerializationError, match="unknown serialization header"):
        method_of(blob)
    with pytest.raises(SerializationError, match="unknown serialization header"):
        deserialize(blob)


def test_non_bytes_is_serialization_error() -> None:
    for v in ("json\n1", None, 5, [b"json\n1"]):
        with pytest.raises(SerializationError, match="expected bytes"):
            deserialize(v)  # type: ignore[arg-type]


def test_deserialize_accepts_bytes_like() -> None:
    assert deserialize(bytearray(b"json\n[1]")) == [1]
    assert deserialize(memoryview(b"json\n[1]")) == [1]


_GOOD_PICKLE = serialize(("a tuple", [1, 2, 3], {"k": b"v"}))


@pytest.mark.parametrize(
    "blob",
    [
        b"pickle\n",
        b"pickle\ngarbage",
        _GOOD_PICKLE[:-1],  # truncated: no STOP opcode
        _GOOD_PICKLE[: len(_GOOD_PICKLE) // 2],
        b"pickle\n" + pickle.dumps(1, protocol=5)[:2] + b"\xff" * 8,
        b"pickle\n\x80\x05cno_such_module_xyz\nthing\n.",  # global from a module that is not there
        b"pickle\n\x80\x05cbuiltins\nno_such_attribute_xyz\n.",
        b"dill\n\x00\x01",
        b"json\n{",
        b"json\n\xff\xfe",
        b"json\nNaNx",
        b"source\n\xff\xfe",  # not UTF-8
        b"source\nf\ndef f(:\n",  # syntax error
        b"source\ng\ndef f():\n    return 1\n",  # does not define the named function
        b"source\nf\nraise RuntimeError('boom at import')\n",
    ],
)
def test_corrupt_blobs_raise_serialization_error_only(blob: bytes) -> None:
    with pytest.raises(SerializationError):
        deserialize(blob)


@pytest.mark.parametrize("pos", range(len(b"pickle\n"), len(_GOOD_PICKLE)))
def test_single_byte_corruption_of_a_pickle_never_escapes(pos: int) -> None:
    bad = bytearray(_GOOD_PICKLE)
    bad[pos] ^= 0xFF
    try:
        deserialize(bytes(bad))
    except SerializationError:
        pass


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.sampled_from([b"json\n", b"pickle\n", b"", b"jso", b"other\n"]), rest=st.binary(max_size=64))
def test_arbitrary_blobs_only_raise_serialization_error(header: bytes, rest: bytes) -> None:
    """Any bytes after a data header: a value or SerializationError, never another exception.

    (dill and source are left out: a random program is not something to exec in a unit test.)
    """
    try:
        deserialize(header + rest)
    except SerializationError:
        pass


# ---------------------------------------------------------------------------------- error blobs
def test_error_dict_format() -> None:
    try:
        raise ValueError("bad input")
    except ValueError as exc:
        err = make_error(exc)
    assert list(err) == ["type", "message", "traceback", "exception"]
    assert err["type"] == "builtins.ValueError" and err["message"] == "bad input"
    assert "Traceback (most recent call last)" in err["traceback"] and "ValueError: bad input" in err["traceback"]
    blob = serialize(err)
    assert method_of(blob) == "pickle"  # "exception" holds pickled bytes, which JSON cannot carry
    back = deserialize(blob)
    assert back["type"] == "builtins.ValueError"
    rebuilt = pickle.loads(back["exception"])
    assert isinstance(rebuilt, ValueError) and rebuilt.args == ("bad input",)


def test_error_dict_without_exception_is_json() -> None:
    class NeedsTwo(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}/{b}")

    try:
        raise NeedsTwo(1, 2)
    except NeedsTwo as exc:
        err = make_error(exc)
    assert err["exception"] is None  # it would not unpickle, so it is not sent
    blob = serialize(err)
    assert method_of(blob) == "json"
    assert deserialize(blob)["message"] == "1/2"


# ---------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("value", ["\ud800", {"k\udcff": 1}, ["ok", "\udfff"]])
def test_lone_surrogates_fall_back_to_pickle(value: Any) -> None:
    blob = serialize(value)
    assert deserialize(blob) == value


def test_a_lambda_over_a_socket_names_the_socket_not_the_surrounding_line() -> None:
    """Issue 13 item 5: the source fallback used to send the whole line around a lambda, and the
    endpoint failed with "name 'record' is not defined"."""
    import socket

    from mesh_agent.protocol import SerializationError, serialize_function

    s = socket.socket()
    try:
        with pytest.raises(SerializationError) as info:
            record = serialize_function(lambda: s.send(b"x"))  # noqa: F841
        msg = str(info.value)
        assert "'s'" in msg and "socket.socket" in msg and "inside the function" in msg
        assert "record" not in msg
    finally:
        s.close()


def test_a_closure_never_falls_back_to_source_text() -> None:
    import socket

    from mesh_agent.protocol import SerializationError, serialize_function

    def make(conn: socket.socket):  # type: ignore[no-untyped-def]
        def send_it() -> int:
            return conn.send(b"x")
        return send_it

    s = socket.socket()
    try:
        with pytest.raises(SerializationError, match="'conn'"):
            serialize_function(make(s))
    finally:
        s.close()


def test_this_projects_packages_are_classified_without_scanning_every_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """cloud_hub, fl, ... are never the user's own (every endpoint has them). Deciding so must not
    take the ~100 ms scan of installed distributions: in a source checkout a worker paid it inside
    the first task after a ref argument imported cloud_hub.client, and the scheduler learned that
    task's run time as ~100 ms too slow (a data-locality test then placed work away from its data)."""
    import importlib

    ser = importlib.import_module("mesh_agent.protocol.serialize")  # the module (the package exports a function of that name)

    def no_scan() -> frozenset[str]:
        raise AssertionError("scanned every installed distribution")

    monkeypatch.setattr(ser, "_distributions", no_scan)
    for top in ("cloud_hub", "mesh_agent", "fl", "scheduler", "sim"):
        assert ser._is_users_own(top) is False


def test_the_known_packages_are_the_ones_pyproject_ships() -> None:
    """``_OURS`` repeats pyproject's package list (an installed wheel has no pyproject to read):
    a package added there and not here would be scanned for again, or worse, shipped by value."""
    import importlib
    import tomllib
    from pathlib import Path

    ser = importlib.import_module("mesh_agent.protocol.serialize")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    shipped = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert shipped == set(ser._OURS)


def _run(prog: str, cwd: Path) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", prog], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_sdk_changes_no_serializer_setting(tmp_path: Path) -> None:
    """Importing cloud_hub.client used to set a process-wide flag in the serializer, so a worker
    that loaded the SDK to resolve a ref argument serialized differently afterwards (a flaky test
    was traced to it). Nothing in the serializer module changes when the SDK is imported."""
    prog = ("import importlib\n"
            "ser = importlib.import_module('mesh_agent.protocol.serialize')\n"
            "plain = (bool, int, float, str, bytes, type(None), frozenset)\n"
            "before = {k: v for k, v in vars(ser).items() if isinstance(v, plain)}\n"
            "import cloud_hub.client, cloud_hub.client.refs\n"
            "after = {k: v for k, v in vars(ser).items() if isinstance(v, plain)}\n"
            "print(sorted(k for k in set(before) | set(after) if before.get(k, ...) != after.get(k, ...)))\n")
    assert _run(prog, tmp_path) == "[]"


def test_the_sdk_asks_for_user_modules_per_call(tmp_path: Path) -> None:
    """``serialize(value, user_modules=True)`` (what the SDK sends arguments with) finds a module
    of the user's own imported since the last look and sends data naming it by value; the default
    (an agent's results) does not look, whatever else the process imported."""
    (tmp_path / "mesh_user_mod_x.py").write_text("class Thing:\n    def __init__(self, n):\n        self.n = n\n")
    prog = ("import sys; sys.path.insert(0, '.')\n"
            "import cloud_hub.client\n"
            "import mesh_user_mod_x\n"
            "from mesh_agent.protocol.serialize import method_of, serialize\n"
            "t = mesh_user_mod_x.Thing(3)\n"
            "print(method_of(serialize(t)), method_of(serialize(t, user_modules=True)))\n")
    assert _run(prog, tmp_path) == "pickle cloudpickle"
