"""The hub reads a failed result's exception type without running anything the agent sent."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from cloud_hub.placement import error_type
from mesh_agent.engine._worker import make_error
from mesh_agent.protocol import serialize


def test_error_type_from_json_and_pickled_error_dicts() -> None:
    try:
        import definitely_not_installed_module  # type: ignore[import-not-found]  # noqa: F401
    except ModuleNotFoundError as exc:
        blob = serialize(make_error(exc))  # with the pickled exception inside: a pickle
    assert blob.startswith(b"pickle\n")
    assert error_type(blob) == "ModuleNotFoundError"
    assert error_type(serialize({"type": "builtins.MemoryError", "message": "", "traceback": "", "exception": None})) == "MemoryError"
    for junk in (None, b"", b"json\n{", b"json\n[1]", b"dill\n...", b"pickle\n\x80\x05junk", serialize({"type": 7})):
        assert error_type(junk) is None


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.path,))


def test_a_malicious_pickle_is_never_executed(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    blob = b"pickle\n" + pickle.dumps({"type": "X", "exception": _Evil(str(target))}, protocol=5)
    assert error_type(blob) is None
    assert not target.exists()
