"""Result payloads a hostile endpoint (or a tenant forging its own result frame) sends to a user's SDK.

Each is the exact ``data`` bytes of a result (``<method>\\n`` + body), as the agent forwards it.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any


class _R:
    """An object whose pickle is ``fn(*args)`` (then ``BUILD state``): how a sender names any callable."""

    def __init__(self, fn: Any, args: tuple, state: Any = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def code_payloads(marker: str) -> dict[str, bytes]:
    """Payloads that would run code (or corrupt memory) if unpickled; each must be refused."""
    import numpy as np

    try:
        from numpy._core import multiarray as ma  # numpy 2
    except ImportError:  # pragma: no cover - numpy 1
        from numpy.core import multiarray as ma  # type: ignore[no-redef]

    out: dict[str, bytes] = {}
    out["reduce_os_system"] = b"pickle\n" + pickle.dumps(_R(os.system, (f"touch {marker}.os_system",)), protocol=2)
    out["reduce_exec"] = b"pickle\n" + pickle.dumps(_R(exec, (f"open({marker + '.exec'!r}, 'w').write('x')",)), protocol=4)
    out["reduce_in_list"] = b"pickle\n" + pickle.dumps([1, 2, {"a": _R(exec, (f"open({marker + '.nested'!r}, 'w')",))}], protocol=5)
    out["numpy_object_array"] = b"pickle\n" + pickle.dumps(np.array([1, "x", None], dtype=object), protocol=5)
    out["numpy_object_array_evil"] = b"pickle\n" + pickle.dumps(
        np.array([_R(exec, (f"open({marker + '.npobj'!r}, 'w')",)), 1], dtype=object), protocol=5)
    out["numpy_structured_object_field"] = b"pickle\n" + pickle.dumps(np.zeros(2, dtype=[("a", "O"), ("b", "f8")]), protocol=5)
    # float64 whose pickled state claims the object flags: if numpy applied it, the 16 bytes below
    # would be read as two PyObject pointers (0x4141..., 0x4242...)
    evil_dtype = _R(np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 0x3F))
    evil_arr = _R(ma._reconstruct, (np.ndarray, (0,), b"b"),
                  (1, (2,), evil_dtype, False, struct.pack("<QQ", 0x4141414141414141, 0x4242424242424242)))
    out["numpy_dtype_flags_forged"] = b"pickle\n" + pickle.dumps(evil_arr, protocol=2)
    out["numpy_dtype_alone_forged"] = b"pickle\n" + pickle.dumps(evil_dtype, protocol=2)
    out["numpy_masked_subclass"] = b"pickle\n" + pickle.dumps(np.ma.masked_array([1.0, 2.0], mask=[0, 1]), protocol=5)
    out["cloudpickle_header"] = b"cloudpickle\n" + pickle.dumps(_R(exec, (f"open({marker + '.cp'!r}, 'w')",)), protocol=5)
    out["dill_header"] = b"dill\n" + pickle.dumps(_R(exec, (f"open({marker + '.dill'!r}, 'w')",)), protocol=5)
    out["source_header"] = b"source\nmain\ndef main():\n    open(" + repr(marker + ".src").encode() + b", 'w')\n"
    out["persistent_id"] = b"pickle\n" + b"\x80\x02P0\n."
    out["builtins_getattr"] = b"pickle\n" + pickle.dumps(_R(getattr, (_R(__import__, ("os",)), "system")), protocol=2)
    return out


def dos_payloads() -> dict[str, bytes]:
    """Data-shaped payloads meant to crash or hang the decoder (deep nesting)."""
    n = 1_000_000
    out = {
        "nested_lists_1e6": b"pickle\n\x80\x05" + b"]" * n + b"a" * (n - 1) + b".",
        "nested_tuples_1e6": b"pickle\n\x80\x05N" + b"\x85" * n + b".",
        "nested_json_2e5": b"json\n" + b"[" * 200_000 + b"]" * 200_000,
        "huge_bytes_claim": b"pickle\n\x80\x05\x8e" + struct.pack("<Q", 2**60) + b"abc",
    }
    return out


def error_payloads(marker: str) -> dict[str, bytes]:
    """Error dicts (``ok=False``) whose type or pickled exception aims at the SDK's exception rebuild."""
    evil_exc = pickle.dumps(_R(exec, (f"open({marker + '.exc'!r}, 'w')",)), protocol=5)
    mk = lambda t, m: b"pickle\n" + pickle.dumps({"type": t, "message": m, "traceback": "remote tb", "exception": evil_exc}, protocol=5)  # noqa: E731
    return {
        "system_exit": mk("builtins.SystemExit", "bye"),
        "keyboard_interrupt": mk("builtins.KeyboardInterrupt", "stop"),
        "generator_exit": mk("builtins.GeneratorExit", "stop"),
        "os_system_type": mk("posix.system", "touch x"),
        "keyerror_deep_literal": mk("builtins.KeyError", "(" * 2000 + ")" * 2000),
        "value_error": mk("builtins.ValueError", "plain"),
    }


def data_payload() -> bytes:
    import numpy as np

    return b"pickle\n" + pickle.dumps({"w": np.arange(4, dtype=np.float64), "n": 3, "s": "ok"}, protocol=5)
