"""The console reads device result blobs without ever running what a device sent."""

from __future__ import annotations

import os
import pickle

import pytest

from cloud_hub.console.blobs import MAX_DECODE_BYTES, NotPlainData, describe_result, safe_load
from mesh_agent.engine import make_error
from mesh_agent.protocol import serialize


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch /tmp/console-blob-pwned",))


def test_plain_data_round_trips() -> None:
    for value in [1, 2.5, "x", None, [1, "a"], {"k": (1, 2)}, b"bytes", {"nested": {"set": {1, 2}}}]:
        assert safe_load(serialize(value)) == value


def test_globals_are_refused_and_never_called(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = "/tmp/console-blob-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    blob = b"pickle\n" + pickle.dumps(_Boom())
    with pytest.raises(NotPlainData, match="not plain data"):
        safe_load(blob)
    assert not os.path.exists(marker)
    import numpy as np

    with pytest.raises(NotPlainData):
        safe_load(serialize(np.arange(3)))


def test_code_headers_oversize_and_garbage_are_not_decoded() -> None:
    for blob in [b"dill\n\x80\x04N.", b"source\nf\ndef f(): pass", b"nonsense", b"", None, b"pickle\n\x80\x05garbage",
                 b"json\n{not json", b"pickle\n" + b"\x80" * 10]:
        with pytest.raises(NotPlainData):
            safe_load(blob)  # type: ignore[arg-type]
    with pytest.raises(NotPlainData, match="preview limit"):
        safe_load(b"json\n" + b" " * (MAX_DECODE_BYTES + 1))


def test_describe_failed_task_shows_remote_traceback() -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        blob = serialize(make_error(exc))
    d = describe_result(False, blob)
    assert d["error_type"] == "KeyError"
    assert "missing" in d["error_message"]
    assert "Traceback (most recent call last)" in d["traceback"]
    assert d["method"] == "pickle"


def test_describe_success_and_undecodable_results() -> None:
    assert describe_result(True, serialize([1, 2, 3]))["preview"] == "[1, 2, 3]"
    d = describe_result(True, b"pickle\n" + pickle.dumps(_Boom()))
    assert d["preview"] is None and "not decoded" in d["note"]
    d = describe_result(False, b"garbage")
    assert d["error_type"] == "unknown" and d["method"] == "unknown"
    assert describe_result(None, None)["preview"] is None
