"""Layers point one way (issue 26 item 1; docs/architecture.md "Layers").

Every ``.py`` under mesh_agent/, scheduler/, cloud_hub/ and fl/ is parsed with ``ast``; every
import counts wherever it is: at module level, inside a function (a lazy import is still a
dependency), under ``if TYPE_CHECKING:``, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name. A failure names file:line, what is imported and the
rule it breaks. Then two circle checks: the hub's service and API modules (imports made when a
module is loaded), and the SDK (every import, lazy ones too).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mesh_agent", "scheduler", "cloud_hub", "fl")


@dataclass(frozen=True)
class Import:
    file: str  # relative, posix
    line: int
    module: str  # what is imported, absolute (``from a.b import c`` gives ``a.b`` and ``a.b.c``)
    at_load: bool  # runs when the module is loaded (not in a function body, not type-checking only)
    names: tuple[str, ...] = ()  # ``from module import names`` (on the record of ``module`` itself)


@dataclass(frozen=True)
class Rule:
    text: str
    files: tuple[str, ...]  # path prefixes the rule applies to
    forbidden: tuple[str, ...]  # module prefixes
    allowed: tuple[str, ...] = ()  # module prefixes allowed although forbidden matched
    except_files: tuple[str, ...] = ()  # path prefixes exempt from the rule

    def applies(self, file: str) -> bool:
        return file.startswith(self.files) and not (self.except_files and file.startswith(self.except_files))

    def breaks(self, module: str) -> bool:
        return _under(module, self.forbidden) and not _under(module, self.allowed)


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


OURS = ("mesh_agent", "scheduler", "cloud_hub", "fl", "sim", "bench", "tests")

RULES = (
    Rule("mesh_agent imports neither cloud_hub nor fl (the agent is below the hub, the SDK and FL)",
         ("mesh_agent/",), ("cloud_hub", "fl")),
    Rule("mesh_agent/protocol is the bottom layer: it imports nothing of this project outside mesh_agent.protocol",
         ("mesh_agent/protocol/",), OURS, allowed=("mesh_agent.protocol",)),
    Rule("scheduler imports nothing of this project (pure logic)",
         ("scheduler/",), ("mesh_agent", "cloud_hub", "fl", "sim", "bench", "tests")),
    Rule("cloud_hub imports fl only in its demo (cloud_hub/demo.py)",
         ("cloud_hub/",), ("fl",), except_files=("cloud_hub/demo.py",)),
    Rule("the service layer (cloud_hub/service) imports neither cloud_hub.api nor a web framework",
         ("cloud_hub/service/",), ("cloud_hub.api", "fastapi", "starlette", "uvicorn")),
    Rule("below the HTTP layer nothing imports cloud_hub.api (only api/, the console and cloud_hub/server.py may)",
         ("cloud_hub/",), ("cloud_hub.api",), except_files=("cloud_hub/api/", "cloud_hub/console/", "cloud_hub/server.py")),
    Rule("the SDK (cloud_hub.client) imports nothing of the hub, the scheduler or fl",
         ("cloud_hub/client/",), ("cloud_hub", "scheduler", "fl"), allowed=("cloud_hub.client",)),
    Rule("library code imports neither bench, sim nor tests (they sit on top; the hub's demo may drive sim)",
         tuple(f"{p}/" for p in PACKAGES), ("bench", "sim", "tests"), except_files=("cloud_hub/demo.py",)),
)


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, rel: Path) -> list[Import]:
    """Every import in ``source`` (the file ``rel``, relative to the repository root)."""
    file = rel.as_posix()
    me = _module_name(rel)
    package = me if rel.name == "__init__.py" else me.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Import(file, node.lineno, a.name, at_load) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            out.append(Import(file, node.lineno, module, at_load, tuple(a.name for a in node.names)))
            out.extend(Import(file, node.lineno, f"{module}.{a.name}", at_load) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append(Import(file, node.lineno, node.args[0].value, False))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_load = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            visit(node.test, at_load)
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_load)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_load)

    visit(ast.parse(source, file), True)
    return out


def _files() -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _all_imports() -> list[Import]:
    out: list[Import] = []
    for path in _files():
        out.extend(imports_of(path.read_text(), path.relative_to(ROOT)))
    return out


IMPORTS = _all_imports()
MODULES = {_module_name(p.relative_to(ROOT)) for p in _files()}


def test_the_parser_sees_lazy_type_checking_relative_and_dynamic_imports() -> None:
    src = ("from __future__ import annotations\nimport importlib\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from cloud_hub.api.hub import Hub\n"
           "def f():\n    from cloud_hub import api\n    importlib.import_module('fl.wire')\n    return __import__('sim')\n"
           "from ..store import memo\n")
    got = {(i.line, i.module, i.at_load) for i in imports_of(src, Path("cloud_hub/service/x.py"))}
    assert (5, "cloud_hub.api.hub.Hub", False) in got
    assert (7, "cloud_hub.api", False) in got
    assert (8, "fl.wire", False) in got and (9, "sim", False) in got
    assert (10, "cloud_hub.store.memo", True) in got
    assert (1, "__future__", True) in got


def test_every_import_respects_the_layers() -> None:
    broken: list[str] = []
    for rule in RULES:
        seen: set[tuple[str, int]] = set()
        for imp in IMPORTS:
            if rule.applies(imp.file) and rule.breaks(imp.module) and (imp.file, imp.line) not in seen:
                seen.add((imp.file, imp.line))
                broken.append(f"{imp.file}:{imp.line}: imports {imp.module}: {rule.text}")
    assert not broken, "imports against the layers (docs/architecture.md, \"Layers\"):\n" + "\n".join(broken)


def test_each_rule_applies_to_files_that_exist() -> None:
    """A rule whose files were moved away would pass silently: each must still cover some file."""
    files = {i.file for i in IMPORTS}
    for rule in RULES:
        assert any(rule.applies(f) for f in files), rule.text


def _target(module: str, within: set[str]) -> str | None:
    """The module of ours an imported name is (``a.b.c`` may be module ``a.b.c`` or name ``c`` of ``a.b``)."""
    while module and module not in within:
        module = module.rpartition(".")[0]
    return module or None


def _graph(prefixes: tuple[str, ...], at_load_only: bool) -> dict[str, set[str]]:
    within = {m for m in MODULES if _under(m, prefixes)}
    graph: dict[str, set[str]] = {m: set() for m in within}
    for imp in IMPORTS:
        if at_load_only and not imp.at_load:
            continue
        src = _module_name(Path(imp.file))
        if src not in within:
            continue
        if imp.names and all(f"{imp.module}.{n}" in within for n in imp.names):
            continue  # ``from P import sub`` is ``import P.sub``: the edge is to the submodule (its own record)
        dst = _target(imp.module, within)
        # a module's own parent packages are loaded before it whatever it imports: no edge to them
        if dst is not None and dst != src and not src.startswith(dst + "."):
            graph[src].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _describe(graph: dict[str, set[str]], cycles: Iterable[list[str]]) -> str:
    lines = []
    for comp in cycles:
        lines.append(" <-> ".join(comp))
        lines.extend(f"    {m} imports {', '.join(sorted(graph[m] & set(comp)))}" for m in comp)
    return "\n".join(lines)


def test_no_import_circle_among_the_service_and_api_modules() -> None:
    graph = _graph(("cloud_hub.service", "cloud_hub.api"), at_load_only=True)
    assert "cloud_hub.service.hub" in graph and "cloud_hub.api.app" in graph
    cycles = _cycles(graph)
    assert not cycles, "import circles (imports made when a module loads):\n" + _describe(graph, cycles)


def test_no_import_circle_in_the_sdk_even_through_lazy_imports() -> None:
    """cloud_hub.client: refs -> the local tier -> the Redis proxies -> their settings -> the
    shared Executor -> refs was a circle held together by imports inside functions; none is left."""
    graph = _graph(("cloud_hub.client",), at_load_only=False)
    assert "cloud_hub.client.refs" in graph and "cloud_hub.client.multiprocessing._state" in graph
    cycles = _cycles(graph)
    assert not cycles, "import circles in the SDK (lazy and type-checking imports count):\n" + _describe(graph, cycles)


# ---------------------------------------------------------------------- SQL lives in the store
# Issue 26 item 2: every SQL statement of the hub is in cloud_hub/store/, one module per concern
# (docs/architecture.md, "Hub store"). A string literal (implicitly concatenated parts are one
# literal; an f-string counts with its fields as "{}") outside cloud_hub/store/ that looks like a
# statement fails: SELECT ... FROM, INSERT [OR ...] INTO, REPLACE INTO, UPDATE x SET, DELETE FROM,
# CREATE [TEMP] TABLE, and a literal that is a PRAGMA, BEGIN, COMMIT or ROLLBACK. Keywords in
# capitals, as this project writes SQL, so prose does not match;
# docstrings are not statements and are skipped. Not SQL, so not listed below: cloud_hub/kv/ is
# the Redis-protocol key-value server (its "SELECT" is the Redis command; its keyspace lives in
# memory) and the SDK's multiprocessing modules call Redis pipelines' ``execute()``; the SDK's
# local refs.sqlite3 is mesh_agent/refstore.py's. cloud_hub/backup.py keeps only file handling on
# SQLite files (connections, the backup API, fsync): its statements are cloud_hub/store/backup.py's.
# sim/ is scanned too: the simulator reads a stopped hub's file through cloud_hub/store/readback.py.

SQL_STATEMENT = re.compile(
    r"\bSELECT\b[^;]*?\bFROM\b|\bINSERT\s+(?:OR\s+[A-Z]+\s+)?INTO\b|\bREPLACE\s+INTO\b|\bUPDATE\s+\S+\s+SET\b"
    r"|\bDELETE\s+FROM\b|\bCREATE\s+(?:TEMP(?:ORARY)?\s+)?TABLE\b"
    r"|^\s*PRAGMA\s+[a-z_]+|^\s*BEGIN(?:\s+(?:IMMEDIATE|EXCLUSIVE|DEFERRED|TRANSACTION))?\s*$|^\s*(?:COMMIT|ROLLBACK)\s*$"
)

#: (file, pattern the literal starts with): SQL allowed outside cloud_hub/store/, each with why.
#: An entry that no longer matches anything fails too (remove it when its statement moves).
SQL_ALLOWED: tuple[tuple[str, str], ...] = (
    # none today: every statement lives in cloud_hub/store/
)


def sql_literals(source: str, file: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal in ``source`` that looks like a SQL statement."""
    tree = ast.parse(source, file)
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # read as part of the f-string
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}" for v in node.values)
        else:
            continue
        if SQL_STATEMENT.search(text):
            out.append((node.lineno, text))
    return sorted(out)


def _sql_outside_store() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted([*(ROOT / "cloud_hub").rglob("*.py"), *(ROOT / "sim").rglob("*.py")]):
        file = path.relative_to(ROOT).as_posix()
        if not file.startswith("cloud_hub/store/"):
            out.extend((file, line, text) for line, text in sql_literals(path.read_text(), file))
    return out


def test_the_sql_finder_sees_statements_in_literals_and_f_strings_not_in_docstrings_or_prose() -> None:
    src = ('def f(db, t):\n    """SELECT x FROM y in a docstring is not a statement."""\n'
           '    db.execute("SELECT a, b "\n               "FROM t WHERE c=?", (1,))\n'
           '    db.execute(f"DELETE FROM {t} WHERE x=?")\n    db.execute(f"UPDATE {t} SET a=1")\n'
           '    db.execute("INSERT OR REPLACE INTO m VALUES (?)")\n    db.execute("CREATE TABLE IF NOT EXISTS z (a)")\n'
           '    log("select the endpoints from the list; update the settings; delete from disk")\n'
           '    redis.execute_command("SELECT", 0)\n    db.execute("PRAGMA quick_check")\n'
           '    db.execute("BEGIN IMMEDIATE")\n    db.execute("COMMIT")\n    say("Begin here; commit later")\n')
    assert [line for line, _ in sql_literals(src, "x.py")] == [3, 5, 6, 7, 8, 11, 12, 13]


def test_all_sql_lives_in_the_store() -> None:
    found = _sql_outside_store()
    stray = [f"{f}:{line}: {text[:100]!r}" for f, line, text in found
             if not any(f == af and re.match(start, text) for af, start in SQL_ALLOWED)]
    assert not stray, ("SQL outside cloud_hub/store/ (move it into a store module named for its concern, a function "
                       "taking the connection; docs/architecture.md \"Hub store\"):\n" + "\n".join(stray))
    stale = [entry for entry in SQL_ALLOWED if not any(f == entry[0] and re.match(entry[1], text) for f, _, text in found)]
    assert not stale, f"SQL_ALLOWED entries that match nothing any more (remove them): {stale}"
