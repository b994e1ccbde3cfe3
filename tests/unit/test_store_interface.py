"""The store's interface (cloud_hub/store/interface.py): both backends provide every method the
hub may call, with the same signature, and the hub calls no public store method outside it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from cloud_hub.store import Store
from cloud_hub.store.postgres import PostgresStore
from cloud_hub.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[2]


def _methods() -> list[str]:
    return [n for n, v in vars(Store).items() if not n.startswith("_") and (callable(v) or isinstance(v, staticmethod))]


def _params(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def test_both_backends_provide_the_interface() -> None:
    names = _methods()
    assert len(names) > 40
    for backend in (SqliteStore, PostgresStore):
        for name in names:
            assert hasattr(backend, name), f"{backend.__name__} lacks {name}"
            assert _params(getattr(backend, name)) == _params(getattr(Store, name)), f"{backend.__name__}.{name} differs from Store.{name}"


def test_the_hub_calls_only_interface_methods_on_its_store() -> None:
    """``store.x(`` calls in the hub outside cloud_hub/store name a method of the interface (or of
    the hub's other stores: FL, memo settings, the embedded key-value store)."""
    public = set(_methods())
    other = {"get", "put", "delete", "load", "save", "prune", "listen"}  # FLStore / kv / PostgreSQL listener
    called: set[tuple[str, str]] = set()
    for path in (ROOT / "cloud_hub").rglob("*.py"):
        if "store" in path.relative_to(ROOT / "cloud_hub").parts[:1]:
            continue
        for m in re.finditer(r"\bstore\.([a-z_]+)\(", path.read_text()):
            called.add((m.group(1), str(path.relative_to(ROOT))))
    unknown = sorted((n, f) for n, f in called if n not in public and n not in other and hasattr(SqliteStore, n))
    assert not unknown, f"store methods called outside the interface (add them to cloud_hub/store/interface.py): {unknown}"
