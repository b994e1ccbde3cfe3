"""Value, Array, RawValue, RawArray: packed C values in one Redis string.

Why a packed string: element i lives at byte ``i * itemsize``, so ``a[i]`` is one ``GETRANGE``,
``a[i] = x`` one ``SETRANGE`` and ``a[:]`` one ``GET``; nothing is pickled. Every access is still
a network round trip (about 0.1-0.3 ms on a LAN): a loop over single elements is slow, as the
Lithops paper found for its Array; read and write whole slices (``a[:]``) instead.

Why ctypes does the packing (not ``struct``): the standard library's objects *are* ctypes
objects, so converting every value through the same ctypes type gives the same results and the
same errors as CPython: ``Array('c', b'hello')`` takes bytes and ``a[:]`` returns bytes, ``'u'``
takes and returns ``str``, an out-of-range int wraps as C does, a float for ``'i'`` is a
``TypeError``. The layout is fixed by the program's own type (its kind and size, little-endian),
so a worker on another architecture (a 32-bit Pi, where ``c_long`` has 4 bytes) reads the same
bytes with a type of the same size.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any, Iterator

from cloud_hub.client.multiprocessing._resource import Resource
from cloud_hub.client.multiprocessing.synchronize import RLock

__all__ = ["Value", "Array", "RawValue", "RawArray", "typecode_to_type"]

#: the standard library's table (multiprocessing.sharedctypes.typecode_to_type)
typecode_to_type = {"c": ctypes.c_char, "u": ctypes.c_wchar, "b": ctypes.c_byte, "B": ctypes.c_ubyte, "h": ctypes.c_short,
                    "H": ctypes.c_ushort, "i": ctypes.c_int, "I": ctypes.c_uint, "l": ctypes.c_long, "L": ctypes.c_ulong,
                    "q": ctypes.c_longlong, "Q": ctypes.c_ulonglong, "f": ctypes.c_float, "d": ctypes.c_double}
_INTS = {1: (ctypes.c_int8, ctypes.c_uint8), 2: (ctypes.c_int16, ctypes.c_uint16), 4: (ctypes.c_int32, ctypes.c_uint32),
         8: (ctypes.c_int64, ctypes.c_uint64)}
_FLOATS = {4: ctypes.c_float, 8: ctypes.c_double}


def _layout(typecode_or_type: Any) -> tuple[str, int]:
    """(ctypes ``_type_`` letter, size in bytes) of a typecode or a simple ctypes type; a clear
    ``TypeError`` for anything else (before anything is stored)."""
    t = typecode_to_type.get(typecode_or_type, typecode_or_type) if isinstance(typecode_or_type, str) else typecode_or_type
    if isinstance(t, str):
        raise TypeError(f"bad typecode {typecode_or_type!r}: use one of {''.join(typecode_to_type)!r} "
                        "or a simple ctypes type (ctypes.c_int, ctypes.c_bool, ...)")
    letter = getattr(t, "_type_", None)
    if not (isinstance(t, type) and issubclass(t, ctypes._SimpleCData) and isinstance(letter, str)):  # type: ignore[attr-defined]
        raise TypeError(f"unsupported typecode or ctypes type {typecode_or_type!r}: the mesh shares simple ctypes values "
                        f"(typecodes {''.join(typecode_to_type)!r}, ctypes.c_bool, ...), not structures or arrays of them")
    if letter in "zZPO":
        raise TypeError(f"unsupported typecode or ctypes type {t.__name__}: a pointer means nothing in another process "
                        "on another machine; share the data itself (Array('c', b'...'))")
    return letter, ctypes.sizeof(t)


def _ctype(letter: str, size: int) -> Any:
    """The ctypes type with this kind and size here, little-endian (what every copy reads and writes)."""
    if letter in "bhilq" or letter in "BHILQ":
        t = _INTS[size][letter.isupper()]
    elif letter in "fd":
        t = _FLOATS[size]
    else:
        t = {"c": ctypes.c_char, "?": ctypes.c_bool, "u": ctypes.c_wchar, "g": ctypes.c_longdouble}[letter]
        if ctypes.sizeof(t) != size:
            raise TypeError(f"a shared value of ctypes type {letter!r} has {size} bytes where it was made, "
                            f"{ctypes.sizeof(t)} here: it cannot be read on this machine")
    return getattr(t, "__ctype_le__", t)


def _typename(letter: str) -> str:
    return next((c for c, t in typecode_to_type.items() if t._type_ == letter), letter)  # type: ignore[attr-defined]


class _Synchronized(Resource):
    _suffixes = ("data",)

    def __init__(self, layout: tuple[str, int], lock: Any) -> None:
        if lock not in (True, False, None) and not (hasattr(lock, "acquire") and hasattr(lock, "release")):
            raise AttributeError(f"{lock!r} has no method 'acquire'")  # the standard library's error
        super().__init__()
        self._layout = layout
        self._t = _ctype(*layout)
        self._size = layout[1]
        self._lock = RLock() if lock is True else (lock or None)

    def _state(self) -> dict[str, Any]:
        return {"layout": self._layout, "lock": self._lock}

    def _restore(self, state: dict[str, Any]) -> None:
        self._layout, self._lock = tuple(state["layout"]), state["lock"]
        self._t = _ctype(*self._layout)
        self._size = self._layout[1]

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

    def _read(self, start: int = 0, count: int | None = None) -> bytes:
        """``count`` elements from element ``start`` (None: all of them), as stored."""
        if count is None:
            raw = self.call(lambda: self._r.get(self.key("data")))
        else:
            raw = self.call(lambda: self._r.getrange(self.key("data"), start * self._size, (start + count) * self._size - 1))
        if raw is None or (count is not None and len(raw) < count * self._size):
            raise LookupError(f"{self!r} has expired or was deleted (ttl_s)")
        return bytes(raw)

    def _write(self, offset: int, data: bytes) -> None:
        pipe = self._r.pipeline()
        pipe.setrange(self.key("data"), offset, data)
        self.touch(pipe)
        self.call(pipe.execute)


class Value(_Synchronized):
    """``multiprocessing.Value(typecode_or_type, *args, lock=True)``."""

    def __init__(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> None:
        layout = _layout(typecode_or_type)
        data = bytes(_ctype(*layout)(*args))  # the stdlib's conversion and errors, before anything is stored
        super().__init__(layout, lock)
        self._write(0, data)

    @property
    def value(self) -> Any:
        return self._t.from_buffer_copy(self._read(0, 1)).value

    @value.setter
    def value(self, v: Any) -> None:
        obj = self._t()
        obj.value = v
        self._write(0, bytes(obj))

    def get_obj(self) -> "Value":
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {_typename(self._layout[0])!r} {self._prefix} at {self._url}>"


class Array(_Synchronized):
    """``multiprocessing.Array(typecode_or_type, size_or_initializer, lock=True)``. With ``'c'``:
    bytes in and out, and ``.value`` / ``.raw`` as the standard library's ``SynchronizedString``."""

    def __init__(self, typecode_or_type: Any, size_or_initializer: Any, lock: Any = True) -> None:
        layout = _layout(typecode_or_type)
        t = _ctype(*layout)
        if isinstance(size_or_initializer, int):
            arr = (t * size_or_initializer)()
        else:
            arr = (t * len(size_or_initializer))(*size_or_initializer)
        data = bytes(arr)  # converted (or refused) as ctypes does, before anything is stored
        super().__init__(layout, lock)
        self._len = len(arr)
        self.call(lambda: self._r.set(self.key("data"), data, ex=self._ttl))

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "len": self._len}

    def _restore(self, state: dict[str, Any]) -> None:
        super()._restore(state)
        self._len = state["len"]

    def _arr(self, n: int, raw: bytes | None = None) -> Any:
        kind = self._t * n
        return kind() if raw is None else kind.from_buffer_copy(raw)

    def _all(self) -> Any:
        return self._arr(self._len, self._read())

    def __len__(self) -> int:
        return self._len

    def _index(self, i: Any) -> int:
        i = operator.index(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("invalid index")
        return i

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return self._all()[i]
            n = max(0, stop - start)
            return self._arr(n, self._read(start, n) if n else None)[:]
        i = self._index(i)
        return self._arr(1, self._read(i, 1))[0]

    def __setitem__(self, i: Any, v: Any) -> None:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                cur = self._all()
                cur[i] = v
                self._write(0, bytes(cur))
                return
            tmp = self._arr(max(0, stop - start))
            tmp[:] = v  # ctypes' own errors: "Can only assign sequence of same size", a wrong type
            if len(tmp):
                self._write(start * self._size, bytes(tmp))
            return
        i = self._index(i)
        tmp = self._arr(1)
        tmp[0] = v
        self._write(i * self._size, bytes(tmp))

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())

    def _string(self, what: str) -> None:
        letter = self._layout[0]
        if not (letter == "c" or (letter == "u" and what == "value" and self._lock is None)):
            raise AttributeError(f"{type(self).__name__} of {_typename(letter)!r} has no attribute {what!r}")

    @property
    def value(self) -> Any:
        """``'c'``: the bytes up to the first NUL (``RawArray('u')``: the str), as ctypes gives it."""
        self._string("value")
        return self._all().value

    @value.setter
    def value(self, v: Any) -> None:
        self._string("value")
        tmp = self._arr(self._len)
        tmp.value = v  # ctypes' errors: "byte string too long", str for bytes
        self._write(0, bytes(tmp)[:min(len(v) + 1, self._len) * self._size])  # v and its NUL, as ctypes writes

    @property
    def raw(self) -> bytes:
        self._string("raw")
        return bytes(self._all().raw)

    @raw.setter
    def raw(self, v: bytes) -> None:
        self._string("raw")
        tmp = self._arr(self._len)
        tmp.raw = v
        self._write(0, bytes(tmp)[:len(v)])

    def get_obj(self) -> "Array":
        return self

    def __bytes__(self) -> bytes:
        """``bytes()`` as the standard library gives it: a ``RawArray`` is a ctypes array, so its
        buffer; a synchronized one is a sequence, so its items (each an int), as ``bytes(list)``."""
        if self._lock is None:
            return bytes(self._all())
        return bytes(list(self))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {_typename(self._layout[0])!r}[{self._len}] {self._prefix} at {self._url}>"


def RawValue(typecode_or_type: Any, *args: Any) -> Value:
    return Value(typecode_or_type, *args, lock=False)


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> Array:
    return Array(typecode_or_type, size_or_initializer, lock=False)
