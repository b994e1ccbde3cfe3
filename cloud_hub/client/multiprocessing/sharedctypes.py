"""Value, Array, RawValue, RawArray: packed C values in one Redis string.

Why a packed string: element i lives at byte ``i * itemsize``, so ``a[i]`` is one ``GETRANGE``,
``a[i] = x`` one ``SETRANGE`` and ``a[:]`` one ``GET``; nothing is pickled. Every access is still
a network round trip (about 0.1-0.3 ms on a LAN): a loop over single elements is slow, as the
Lithops paper found for its Array; read and write whole slices (``a[:]``) instead.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Iterator

from cloud_hub.client.multiprocessing._resource import Resource
from cloud_hub.client.multiprocessing.synchronize import RLock

__all__ = ["Value", "Array", "RawValue", "RawArray"]

_CTYPES = {ctypes.c_bool: "?", ctypes.c_char: "c", ctypes.c_byte: "b", ctypes.c_ubyte: "B", ctypes.c_short: "h",
           ctypes.c_ushort: "H", ctypes.c_int: "i", ctypes.c_uint: "I", ctypes.c_long: "l", ctypes.c_ulong: "L",
           ctypes.c_longlong: "q", ctypes.c_ulonglong: "Q", ctypes.c_float: "f", ctypes.c_double: "d"}


def _code(typecode_or_type: Any) -> str:
    code = _CTYPES.get(typecode_or_type, typecode_or_type)
    if not isinstance(code, str) or len(code) != 1:
        raise TypeError(f"unsupported typecode or ctypes type: {typecode_or_type!r}")
    try:
        struct.calcsize("<" + code)
    except struct.error:
        raise TypeError(f"bad typecode (must be a struct/array typecode): {code!r}") from None
    return code


class _Synchronized(Resource):
    _suffixes = ("data",)

    def __init__(self, code: str, lock: Any) -> None:
        super().__init__()
        self._code = code
        self._size = struct.calcsize("<" + code)
        self._lock = RLock() if lock is True else (lock or None)

    def _state(self) -> dict[str, Any]:
        return {"code": self._code, "lock": self._lock}

    def _restore(self, state: dict[str, Any]) -> None:
        self._code, self._lock = state["code"], state["lock"]
        self._size = struct.calcsize("<" + self._code)

    def get_lock(self) -> Any:
        if self._lock is None:
            raise AttributeError(f"{type(self).__name__} was made with lock=False: it has no get_lock()")
        return self._lock

    def acquire(self, *a: Any) -> bool:
        return bool(self.get_lock().acquire(*a))

    def release(self) -> None:
        self.get_lock().release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _write(self, offset: int, data: bytes) -> None:
        pipe = self._r.pipeline()
        pipe.setrange(self.key("data"), offset, data)
        self.touch(pipe)
        self.call(pipe.execute)


class Value(_Synchronized):
    """``multiprocessing.Value(typecode_or_type, *args, lock=True)``."""

    def __init__(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> None:
        super().__init__(_code(typecode_or_type), lock)
        self._write(0, struct.pack("<" + self._code, *(args or (0,))))

    @property
    def value(self) -> Any:
        raw = self.call(lambda: self._r.get(self.key("data")))
        if raw is None:
            raise LookupError(f"{self!r} has expired or was deleted (ttl_s)")
        return struct.unpack("<" + self._code, raw)[0]

    @value.setter
    def value(self, v: Any) -> None:
        self._write(0, struct.pack("<" + self._code, v))

    def get_obj(self) -> "Value":
        return self


class Array(_Synchronized):
    """``multiprocessing.Array(typecode_or_type, size_or_initializer, lock=True)``."""

    def __init__(self, typecode_or_type: Any, size_or_initializer: Any, lock: Any = True) -> None:
        super().__init__(_code(typecode_or_type), lock)
        init = [0] * size_or_initializer if isinstance(size_or_initializer, int) else list(size_or_initializer)
        self._len = len(init)
        self.call(lambda: self._r.set(self.key("data"), struct.pack(f"<{self._len}{self._code}", *init), ex=self._ttl))

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "len": self._len}

    def _restore(self, state: dict[str, Any]) -> None:
        super()._restore(state)
        self._len = state["len"]

    def __len__(self) -> int:
        return self._len

    def _all(self) -> list[Any]:
        raw = self.call(lambda: self._r.get(self.key("data")))
        if raw is None:
            raise LookupError(f"{self!r} has expired or was deleted (ttl_s)")
        return list(struct.unpack(f"<{self._len}{self._code}", raw))

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return self._all()[i]
            if stop <= start:
                return []
            raw = self.call(lambda: self._r.getrange(self.key("data"), start * self._size, stop * self._size - 1))
            return list(struct.unpack(f"<{stop - start}{self._code}", raw))
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("invalid index")
        raw = self.call(lambda: self._r.getrange(self.key("data"), i * self._size, (i + 1) * self._size - 1))
        return struct.unpack("<" + self._code, raw)[0]

    def __setitem__(self, i: int | slice, v: Any) -> None:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            vals = list(v)
            if step != 1:
                cur = self._all()
                cur[i] = vals
                self._write(0, struct.pack(f"<{self._len}{self._code}", *cur))
                return
            if len(vals) != max(0, stop - start):
                raise ValueError("Can only assign sequence of same size")
            self._write(start * self._size, struct.pack(f"<{len(vals)}{self._code}", *vals))
            return
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("invalid index")
        self._write(i * self._size, struct.pack("<" + self._code, v))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    def get_obj(self) -> "Array":
        return self


def RawValue(typecode_or_type: Any, *args: Any) -> Value:
    return Value(typecode_or_type, *args, lock=False)


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> Array:
    return Array(typecode_or_type, size_or_initializer, lock=False)
