"""Serializer facade: data by the fastest method that round-trips, code by cloudpickle (dill, then
source text, as fallbacks).

Every serialized blob starts with a header line naming its method (``b"json\\n"``, ``b"pickle\\n"``,
``b"cloudpickle\\n"``, ``b"dill\\n"``, ``b"source\\n"``), so a reader never guesses and a future method
can be added without breaking old agents: an unknown header is a clear error, never a crash.

Why JSON first: most arguments are small plain values; JSON is fast, language-neutral and safe
to inspect in the console. It is used only when it round-trips exactly (no tuples, no non-str
keys, no numpy), otherwise pickle (protocol 5), and cloudpickle for what pickle refuses (lambdas,
closures, local classes) or would send by a reference the endpoint cannot resolve.

What travels by value (docs/sdk.md, "What code travels"): everything defined in ``__main__`` and in
the user's own modules, i.e. modules that are neither in the standard library nor provided by an
installed distribution (a script's sibling ``helpers.py``, a notebook's local package, a test file).
Those modules are registered with cloudpickle's ``register_pickle_by_value``; installed packages
(numpy, torch, this project) travel by reference, as the endpoint has them.
"""

from __future__ import annotations

import json
import pickle
import re
import sys
import types
from typing import Any, Callable, ClassVar

__all__ = [
    "SerializationError",
    "serialize",
    "deserialize",
    "serialize_function",
    "deserialize_function",
    "function_id",
    "method_of",
    "by_value",
    "by_value_modules",
    "missing_code_hint",
]

_JSON = b"json\n"
_PICKLE = b"pickle\n"
_CLOUDPICKLE = b"cloudpickle\n"
_DILL = b"dill\n"
_SOURCE = b"source\n"
_HEADERS = (_JSON, _PICKLE, _CLOUDPICKLE, _DILL, _SOURCE)


class SerializationError(ValueError):
    """A value could not be serialized, or a blob could not be read back."""


def _json_exact(value: Any, depth: int = 0) -> bool:
    """True when ``json.loads(json.dumps(value)) == value`` with the same types all the way down."""
    if depth > 64:
        return False
    t = type(value)
    if t is str:
        return value.isascii() or _utf8_ok(value)
    if t is bool or value is None:
        return True
    if t is int:
        return -(2**63) <= value < 2**63
    if t is float:
        return value == value and value not in (float("inf"), float("-inf"))
    if t is list:
        return all(_json_exact(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and _json_exact(k) and _json_exact(v, depth + 1) for k, v in value.items())
    return False


def _utf8_ok(s: str) -> bool:
    try:
        s.encode()
        return True
    except UnicodeEncodeError:  # lone surrogates: pickle keeps them, JSON text cannot
        return False


def serialize(value: Any, *, user_modules: bool = False) -> bytes:
    """Serialize data (arguments, results) with the fastest method that round-trips exactly.

    A pickle that names ``__main__`` or one of the user's own modules would fail on the endpoint
    (``Can't get attribute 'Tiny' on <module '__main__'>``): such values go by cloudpickle, which
    carries those classes by value. The check is a substring search of the pickle, so plain data
    pays nothing; a false positive only costs the slower method.

    ``user_modules``: also look for the user's own modules imported since the last look (beyond
    ``__main__`` and the modules already found), which costs a scan of the installed distributions
    once per process. The SDK asks for it when it sends arguments (``cloud_hub.client``); an agent's
    results need only ``__main__`` and what its tasks brought by value. Per call, so that importing
    the SDK in a process (a worker resolving a ref argument) changes nothing for other callers."""
    if _json_exact(value):
        return _JSON + json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    try:
        blob = pickle.dumps(value, protocol=5)
    except Exception:  # pickle refuses lambdas, local classes, ...
        blob = None
    if blob is not None and not _names_by_value_module(blob, user_modules):
        return _PICKLE + blob
    try:
        cloudpickle = _cloudpickle()
        return _CLOUDPICKLE + cloudpickle.dumps(value, protocol=5)
    except Exception:
        if blob is not None:
            return _PICKLE + blob
    try:
        import dill

        return _DILL + dill.dumps(value, recurse=True)
    except Exception as exc:
        raise SerializationError(f"cannot serialize value of type {type(value).__name__}: {exc}") from exc


def method_of(blob: bytes) -> str:
    """The method named by a blob's header, e.g. ``"json"``."""
    blob = bytes(blob[:16])
    for header in _HEADERS:
        if blob.startswith(header):
            return header[:-1].decode()
    raise SerializationError(f"unknown serialization header {bytes(blob[:12])!r}")


def missing_code_hint(exc: BaseException) -> str | None:
    """One line for code that cannot be loaded here (a module that is not installed, a class or
    function that is not in the installed version), naming it and saying how to fix it."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (f"module {exc.name!r} is not installed on this endpoint: ship it by value "
                f"(by_value('{exc.name.partition('.')[0]}') in the client, automatic for your own modules) "
                "or install it on the endpoint (an environment with it)")
    text = str(exc)
    if isinstance(exc, AttributeError) and text.startswith("Can't get attribute"):
        # pickle's message: Can't get attribute 'Tiny' on <module '__main__' (built-in)>
        return (f"{text.rstrip('.')}: the installed version differs from the client's, or the code was sent by "
                "reference; ship it by value (by_value(module) in the client) or install the same version on the endpoint")
    return None


class _DataOnly(pickle.Unpickler):
    """Unpickles plain data with the C unpickler: str, bytes, numbers, lists, dicts, tuples, sets,
    bytearray, None; the stream names no class or function. The first name it does ask for is
    either refused (:func:`_refuse`) or, when it is on the data allow-list (complex, numpy
    arrays...), the blob is read again by :class:`_SafeData`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            raise _NeedsAllowList
        raise _refuse(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise SerializationError("it holds a persistent id, which only a trusted sender may send")


class _NeedsAllowList(Exception):
    """The C fast path met an allowed name: read the blob with _SafeData instead."""


def _refuse(module: str, name: str) -> SerializationError:
    if module.partition(".")[0] in ("cloudpickle", "dill"):  # a class or function of the sender's, by value
        return SerializationError(f"it holds code sent by value ({module}.{name}: a class or function), which only a trusted "
                                  "sender may send (unpickling it runs code)")
    return SerializationError(f"it holds {module}.{name}, which only a trusted sender may send (unpickling it runs code)")


#: What a data-only pickle may name, besides the opcodes of plain containers. Every entry maps to a
#: function of ours that checks its arguments, never to the library's own callable: numpy's own
#: unpickling trusts the stream (a dtype's state sets its flags, so a crafted stream can make
#: float64 claim to hold object pointers, or hide an object field in a struct), and only arrays of
#: numbers, booleans, strings and dates are data. Names from numpy 1 (``numpy.core``) and 2
#: (``numpy._core``) pickles, and Python 2-protocol spellings (``__builtin__``, ``_codecs.encode``).
_ALLOWED: dict[tuple[str, str], str] = {
    ("builtins", "complex"): "complex", ("__builtin__", "complex"): "complex",
    ("builtins", "set"): "set", ("__builtin__", "set"): "set",
    ("builtins", "frozenset"): "frozenset", ("__builtin__", "frozenset"): "frozenset",
    ("builtins", "bytearray"): "bytearray", ("__builtin__", "bytearray"): "bytearray",
    ("builtins", "bytes"): "bytes", ("__builtin__", "bytes"): "bytes", ("_codecs", "encode"): "latin1",
    ("collections", "OrderedDict"): "OrderedDict",
    ("numpy", "dtype"): "dtype",
    ("numpy", "ndarray"): "ndarray",
    ("numpy._core.multiarray", "_reconstruct"): "reconstruct", ("numpy.core.multiarray", "_reconstruct"): "reconstruct",
    ("numpy._core.numeric", "_frombuffer"): "frombuffer", ("numpy.core.numeric", "_frombuffer"): "frombuffer",
    ("numpy._core.multiarray", "scalar"): "scalar", ("numpy.core.multiarray", "scalar"): "scalar",
}
#: numpy dtype kinds that are data: bool, signed/unsigned int, float, complex, str, bytes, dates.
_NUMPY_KINDS = frozenset("biufcUSMm")
_DTYPE_SPEC = re.compile(r"^([biufcUSMm])(\d{1,9})$")


class _NdarrayMark:
    """What ``numpy.ndarray`` resolves to: accepted only as ``_reconstruct``'s first argument."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise SerializationError("it calls numpy.ndarray directly, which numpy's pickles never do")


_NDARRAY = _NdarrayMark()


class _SafeData(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The allow-list unpickler (pure Python, so that BUILD, which numpy's dtypes and arrays go
    through, can be checked): plain containers, complex, OrderedDict, and numpy arrays and scalars
    of the kinds in :data:`_NUMPY_KINDS` rebuilt by our checked constructors. Object arrays,
    structured dtypes, subclasses and everything else are refused naming what they hold."""

    dispatch: ClassVar[dict[int, Callable[..., Any]]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    stack: list[Any]  # pickle._Unpickler's, set by load()

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._pending: dict[int, Any] = {}  # id -> dtype or array made by us, waiting for its one BUILD
        self._made: dict[int, Any] = {}  # id -> every dtype made by us (and kept alive, so ids stay unique)

    def persistent_load(self, pid: Any) -> Any:
        raise SerializationError("it holds a persistent id, which only a trusted sender may send")

    def find_class(self, module: str, name: str) -> Any:
        what = _ALLOWED.get((module, name))
        if what is None:
            raise _refuse(module, name)
        if what == "complex":
            return _complex
        if what in ("set", "frozenset"):
            return _container(set if what == "set" else frozenset)
        if what == "bytearray":
            return _bytearray
        if what == "latin1":
            return _latin1
        if what == "bytes":
            return _bytes
        if what == "OrderedDict":
            import collections

            return _container(collections.OrderedDict)
        if what == "ndarray":
            return _NDARRAY
        _numpy()
        return {"dtype": self._dtype, "reconstruct": self._reconstruct, "frombuffer": self._frombuffer, "scalar": self._scalar}[what]

    # ---------------------------------------------------------------- numpy, checked
    def _track(self, obj: Any) -> Any:
        self._pending[id(obj)] = obj
        return obj

    def _dtype(self, spec: Any, align: Any = False, copy: Any = True) -> Any:
        np = _numpy()
        m = _DTYPE_SPEC.match(spec) if isinstance(spec, str) else None
        if m is None:
            what = "object" if isinstance(spec, str) and spec[:1] == "O" else "structured or unknown"
            raise SerializationError(f"it holds a numpy {what} dtype ({spec!r}), which only a trusted sender may send "
                                     "(only arrays of numbers, booleans, strings and dates are data)")
        if align not in (0, 1) or copy not in (0, 1) or type(align) not in (bool, int) or type(copy) not in (bool, int):
            raise SerializationError("it holds a malformed numpy dtype")
        # copy=True always: without it numpy hands out its shared built-in dtype, and the BUILD
        # that follows would change float64 for this whole process.
        dt = np.dtype(spec, False, True)
        self._made[id(dt)] = dt
        return self._track(dt)

    def _checked_dtype(self, dt: Any) -> Any:
        np = _numpy()
        if not isinstance(dt, np.dtype) or self._made.get(id(dt)) is not dt:
            raise SerializationError("it holds a numpy array whose dtype is not a numpy dtype")
        # (mypy narrows dt to Any | None from the identity test above; it is a dtype here)
        if dt.hasobject or dt.kind not in _NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:  # type: ignore[union-attr]
            raise SerializationError(f"it holds a numpy array of dtype {dt!r}, which only a trusted sender may send "
                                     "(only arrays of numbers, booleans, strings and dates are data)")
        self._pending.pop(id(dt), None)  # used: a later BUILD may no longer change it
        return dt

    def _build_dtype(self, dt: Any, state: Any) -> None:
        """Apply ``state`` only when it is exactly the state numpy writes for such a dtype: the
        flags in a dtype's state decide whether numpy treats its bytes as object pointers."""
        np = _numpy()
        spec = dt.str[1:]
        kind = dt.kind
        try:
            if not isinstance(state, tuple) or len(state) not in (8, 9) or state[1] not in ("<", ">", "|", "="):
                raise ValueError
            if kind in "US":
                elsize = state[5]
                if type(elsize) is not int or elsize < 0 or (kind == "U" and elsize % 4):
                    raise ValueError
                want = np.dtype(f"{kind}{elsize // 4 if kind == 'U' else elsize}")
            elif kind in "Mm":
                unit, num = state[8][1][0], state[8][1][1]
                if type(unit) is not bytes or not unit.isalpha() or len(unit) > 7 or type(num) is not int or not 0 < num < 2**31:
                    raise ValueError
                want = np.dtype(f"{kind}8" if unit == b"generic" else f"{kind}8[{num}{unit.decode()}]")
            else:
                want = np.dtype(spec)
            if state[1] in "<>" and want.byteorder != "|":
                want = want.newbyteorder(state[1])
            if want.__reduce__()[1][0] != dt.__reduce__()[1][0] or want.__reduce__()[2] != state:
                raise ValueError
        except (ValueError, TypeError, IndexError, AttributeError):
            raise SerializationError(f"it holds a numpy dtype {spec!r} with a state numpy never writes, which only a trusted "
                                     "sender may send (a dtype's state can make numpy read bytes as object pointers)") from None
        dt.__setstate__(state)

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> Any:
        np = _numpy()
        if subtype is not _NDARRAY:
            raise SerializationError(f"it holds an ndarray subclass ({subtype!r}), which only a trusted sender may send")
        if shape != (0,) or typecode != b"b":  # what numpy always writes; the contents come with BUILD
            raise SerializationError("it holds a malformed numpy array")
        return self._track(np.ndarray((0,), np.uint8))

    def _build_array(self, arr: Any, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise SerializationError("it holds a malformed numpy array")
        if len(state) == 5:
            if state[0] != 1:
                raise SerializationError("it holds a malformed numpy array")
            state = state[1:]
        shape, dt, fortran, raw = state
        dt = self._checked_dtype(dt)
        if (not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape) or type(fortran) is not bool
                or not isinstance(raw, (bytes, bytearray))):
            raise SerializationError("it holds a malformed numpy array")
        n = dt.itemsize
        for d in shape:
            n *= d
        if n != len(raw):
            raise SerializationError(f"it holds a numpy array whose data is {len(raw)} bytes, not the {n} its shape needs")
        arr.__setstate__((1, shape, dt, fortran, raw))

    def _frombuffer(self, buf: Any, dt: Any, shape: Any, order: Any) -> Any:
        np = _numpy()
        dt = self._checked_dtype(dt)
        if (not isinstance(buf, (bytes, bytearray)) or not isinstance(shape, tuple)
                or not all(type(n) is int and n >= 0 for n in shape) or order not in ("C", "F")):
            raise SerializationError("it holds a malformed numpy array")
        return np.frombuffer(buf, dtype=dt).reshape(shape, order=order)

    def _scalar(self, dt: Any, data: Any = None) -> Any:
        dt = self._checked_dtype(dt)
        if type(data) is not bytes or len(data) != dt.itemsize:
            raise SerializationError("it holds a malformed numpy scalar")
        return _numpy_scalar()(dt, data)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._pending.get(id(inst)) is not inst:
            raise SerializationError(f"it sets the state of a {type(inst).__name__}, which only a trusted sender may send")
        del self._pending[id(inst)]
        np = _numpy()
        if isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        else:
            self._build_array(inst, state)

    dispatch[pickle.BUILD[0]] = _load_build


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise SerializationError("it holds numpy arrays, and numpy is not installed here") from None
    return numpy


def _numpy_scalar() -> Any:
    try:
        from numpy._core.multiarray import scalar  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import scalar  # type: ignore[no-redef]
    return scalar


def _complex(*args: Any) -> complex:
    if len(args) > 2 or not all(type(a) in (int, float, str) for a in args):
        raise SerializationError("it holds a malformed complex number")
    return complex(*args)


def _container(kind: Any) -> Callable[..., Any]:
    def make(*args: Any) -> Any:
        if len(args) > 1 or (args and type(args[0]) not in (list, tuple, dict)):
            raise SerializationError(f"it holds a malformed {kind.__name__}")
        return kind(*args)

    return make


def _bytearray(*args: Any) -> bytearray:
    if not args:
        return bytearray()
    if isinstance(args[0], (bytes, bytearray)) and len(args) == 1:
        return bytearray(args[0])
    if isinstance(args[0], str) and len(args) == 2 and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0], "latin1")
    raise SerializationError("it holds a malformed bytearray")


def _bytes(*args: Any) -> bytes:
    if not args:
        return b""
    if len(args) == 1 and type(args[0]) in (bytes, bytearray):
        return bytes(args[0])
    raise SerializationError("it holds a malformed bytes object")


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode``, as protocol 2 spells bytes: only its latin-1 form."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise SerializationError("it holds _codecs.encode with arguments that are not bytes in latin-1")
    return text.encode("latin1")


def load_data(body: bytes) -> Any:
    """Unpickle ``body`` as data only (see :func:`deserialize` with ``trusted=False``): the C
    unpickler when the stream names nothing, the checked allow-list unpickler when it names only
    allowed things; any other name is refused with :class:`SerializationError`."""
    import io

    try:
        try:
            return _DataOnly(io.BytesIO(body)).load()
        except _NeedsAllowList:
            return _SafeData(io.BytesIO(body)).load()
    except SerializationError:
        raise
    except RecursionError:
        raise SerializationError("cannot read pickle payload: nested too deeply") from None
    except Exception as exc:  # truncated or corrupt streams, wrong argument types for allowed names
        raise SerializationError(f"cannot read pickle payload: {type(exc).__name__}: {exc}") from None


def deserialize(blob: bytes, *, trusted: bool = True) -> Any:
    """Read back what :func:`serialize` or :func:`serialize_function` wrote.

    ``trusted=False`` (a result from an endpoint the caller has not marked trusted): JSON and
    data-only pickles (:func:`load_data`: plain containers, complex, numpy arrays of numbers,
    booleans, strings and dates); code and other objects are refused, because unpickling them
    runs the sender's code on the caller's machine."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise SerializationError(f"expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if not trusted and not blob.startswith(_JSON):
        # cloudpickle and dill write pickle streams too, and a value goes to cloudpickle whenever its
        # pickle merely mentions __main__ (an error dict holding a pickled __main__ exception):
        # what decides is what the stream names, which load_data checks, not the header.
        method = method_of(blob)
        if method not in ("pickle", "cloudpickle", "dill"):
            raise SerializationError(f"it is a {method} payload, which only a trusted sender may send (it runs code)")
        return load_data(blob[len(method) + 1 :])
    try:
        if blob.startswith(_JSON):
            return json.loads(blob[len(_JSON) :])
        if blob.startswith(_PICKLE):
            return pickle.loads(blob[len(_PICKLE) :])
        if blob.startswith(_CLOUDPICKLE):  # a plain pickle stream; it imports cloudpickle's helpers itself
            return pickle.loads(blob[len(_CLOUDPICKLE) :])
        if blob.startswith(_DILL):
            import dill

            return dill.loads(blob[len(_DILL) :])
        if blob.startswith(_SOURCE):
            return _load_source(blob[len(_SOURCE) :].decode())
    except SerializationError:
        raise
    except Exception as exc:
        hint = missing_code_hint(exc)
        raise SerializationError(hint or f"cannot deserialize {method_of(blob)} payload: {exc}") from exc
    raise SerializationError(f"unknown serialization header {blob[:12]!r}")


def serialize_function(fn: Callable[..., Any]) -> bytes:
    """Serialize code: cloudpickle first (by value for ``__main__`` and the user's own modules, by
    reference for installed packages), dill when cloudpickle fails, source text when both fail."""
    if not callable(fn):
        raise SerializationError(f"expected a callable, got {type(fn).__name__}")
    try:
        cloudpickle = _cloudpickle()
        return _CLOUDPICKLE + cloudpickle.dumps(fn, protocol=5)
    except Exception as exc:
        first = exc
    try:
        import dill

        return _DILL + dill.dumps(_by_value(fn), recurse=True)
    except Exception:
        pass
    # Source text only for what it can rebuild: a named function that captures nothing. A lambda's
    # "source" is the whole line it sits on, and a closure's source loses the values it captured,
    # so either would fail on the endpoint with a misleading NameError.
    code = getattr(fn, "__code__", None)
    if code is None or fn.__name__ == "<lambda>" or code.co_freevars:
        raise SerializationError(_unsendable(fn, first)) from first
    try:
        import inspect  # only for the source fallback: a worker's start-up should not pay for it
        import textwrap

        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise SerializationError(f"cannot serialize function {getattr(fn, '__name__', fn)!r}: {exc}") from exc
    return _SOURCE + f"{fn.__name__}\n{src}".encode()


def _unsendable(fn: Callable[..., Any], exc: BaseException) -> str:
    """One line naming what a function drags along that cannot be serialized (a socket, a lock, an
    open file, a database connection...) and how to fix it."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    code = getattr(fn, "__code__", None)
    suspects: list[tuple[str, Any]] = []
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        for var, cell in zip(code.co_freevars, cells):
            try:
                suspects.append((var, cell.cell_contents))
            except ValueError:  # an empty cell
                continue
        glb = getattr(fn, "__globals__", {})
        suspects += [(n, glb[n]) for n in code.co_names if n in glb and not isinstance(glb[n], types.ModuleType)]
        suspects += [(f"default of {fn.__name__}()", d) for d in (getattr(fn, "__defaults__", None) or ())]
    cloudpickle = _cloudpickle()
    for var, value in suspects:
        try:
            cloudpickle.dumps(value, protocol=5)
        except Exception:
            kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
            return (f"cannot send function {name}: it uses {var!r} (a {kind}), which cannot be serialized; "
                    f"create it inside the function, or pass what the function needs as arguments")
    return f"cannot send function {name}: {type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ what travels by value
_user_modules: set[str] = set()  # top-level names registered with cloudpickle by value
_by_reference: set[str] = set()  # top-level names the caller said the endpoint has
_classified: dict[str, bool] = {}
_modules_seen = -1
_needle: "re.Pattern[bytes]" = re.compile(rb"\x8c.__main__[.\x94]", re.S)


def _installed(path: str) -> bool:
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {sys.prefix, sys.base_prefix, paths["purelib"], paths["platlib"], paths["stdlib"]}
    return any(path.startswith(r) for r in roots if r)


def _distributions() -> Any:
    """Top-level import names provided by installed distributions, editable installs included
    (their files are outside site-packages, but the endpoint installs them too). Read once."""
    global _dists
    if _dists is None:
        import importlib.metadata

        _dists = frozenset(importlib.metadata.packages_distributions())
    return _dists


_dists: frozenset[str] | None = None


#: This project's own top-level packages (one distribution, continuum-mesh): on every endpoint, so
#: never the user's. _distributions() says the same, but its scan of every installed distribution
#: takes about 100 ms, and a source checkout (editable install) reached it on the first result a
#: worker serialized after a ref argument imported cloud_hub.client: that task's measured run time,
#: which the scheduler learns from, grew by the scan (a data-locality test failed on it).
_OURS = frozenset({"mesh_agent", "cloud_hub", "fl", "scheduler", "sim"})


def _is_users_own(top: str) -> bool:
    if top in ("__main__", "__mp_main__") or top in _OURS or top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        return False
    mod = sys.modules.get(top)
    path = getattr(mod, "__file__", None)
    if not path:  # namespace packages, frozen and dynamic modules: nothing to ship from a file
        return False
    if _installed(path) or "site-packages" in path or "dist-packages" in path:
        return False
    return top not in _distributions()


def _refresh_user_modules() -> None:
    """Register every newly imported module of the user's own with cloudpickle (cheap when no
    module was imported since the last call: one length comparison)."""
    global _modules_seen
    n = len(sys.modules)
    if n == _modules_seen:
        return
    import cloudpickle

    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top in _classified:
            continue
        own = top not in _by_reference and _is_users_own(top)
        _classified[top] = own
        if own and top in sys.modules:
            cloudpickle.register_pickle_by_value(sys.modules[top])
            _user_modules.add(top)
    _set_needle()
    _modules_seen = len(sys.modules)


def _set_needle() -> None:
    """A protocol-5 pickle names a class's module as a short string (``\\x8c``, length, name)
    followed by a memo op or a dot of a submodule; text that merely mentions the name (a
    traceback's file path) does not match."""
    global _needle
    names = b"|".join(re.escape(m.encode()) for m in ("__main__", *sorted(_user_modules)))
    _needle = re.compile(rb"\x8c.(?:" + names + rb")[.\x94]", re.S)


def _cloudpickle() -> Any:
    import cloudpickle

    _refresh_user_modules()
    return cloudpickle


def _names_by_value_module(blob: bytes, user_modules: bool) -> bool:
    """Whether data's pickle names a module that travels by value (then the data goes by value
    too). ``user_modules``: see :func:`serialize`."""
    if user_modules and _modules_seen != len(sys.modules):
        _refresh_user_modules()
    return _needle.search(blob) is not None


def by_value(module: "types.ModuleType | str", value: bool = True) -> None:
    """Say explicitly how a module travels: by value (``True``: the endpoint does not have it) or
    by reference (``False``: it is installed on every endpoint, e.g. your package that an
    environment installs). Overrides the automatic choice for the module's top-level package."""
    import cloudpickle

    name = module if isinstance(module, str) else module.__name__
    top = name.partition(".")[0]
    if top not in sys.modules:
        raise SerializationError(f"module {top!r} is not imported; import it before by_value()")
    _classified[top] = value
    if value:
        _by_reference.discard(top)
        if top not in _user_modules:
            cloudpickle.register_pickle_by_value(sys.modules[top])
            _user_modules.add(top)
    else:
        _by_reference.add(top)
        if top in _user_modules:
            cloudpickle.unregister_pickle_by_value(sys.modules[top])
            _user_modules.discard(top)
    _set_needle()


def by_value_modules() -> list[str]:
    """The top-level modules that currently travel by value (besides ``__main__``)."""
    _refresh_user_modules()
    return sorted(_user_modules)


def _by_value(fn: Callable[..., Any]) -> Callable[..., Any]:
    """For the dill fallback: dill sends only ``__main__`` by value, so a function of the user's
    own module is cloned into ``__main__``. Functions from installed packages stay by reference."""
    if not isinstance(fn, types.FunctionType) or fn.__module__ in ("__main__", None):
        return fn
    mod = sys.modules.get(fn.__module__)
    path = getattr(mod, "__file__", None) or ""
    if not path or _installed(path):
        return fn
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    clone.__qualname__ = fn.__qualname__
    clone.__doc__ = fn.__doc__
    clone.__module__ = "__main__"
    return clone


def _load_source(text: str) -> Callable[..., Any]:
    name, _, src = text.partition("\n")
    namespace: dict[str, Any] = {}
    exec(compile(src, f"<mesh function {name}>", "exec"), namespace)  # noqa: S102 - signed code
    try:
        return namespace[name]
    except KeyError:
        raise SerializationError(f"source payload does not define {name!r}") from None


def deserialize_function(blob: bytes) -> Callable[..., Any]:
    fn = deserialize(blob)
    if not callable(fn):
        raise SerializationError(f"function payload holds a {type(fn).__name__}, not a callable")
    return fn


def function_id(body: bytes) -> str:
    """Content address of a serialized function: the same body always gets the same id."""
    import hashlib

    return hashlib.sha256(body).hexdigest()
