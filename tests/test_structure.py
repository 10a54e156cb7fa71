"""The package's shape, checked from the source with ``ast`` (no imports, no kernel).

Each concern has one home: the store does not reach up into the KV layer, the CLI or the fs
handlers; the KV layer does not reach into the daemon's internals; the names the daemon and
its clients agree on are spelled only in kvfs/protocol.py; background work runs in nurseries.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvfs"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules(sub: str = "") -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def offenders(sub: str, forbidden: tuple[str, ...], allowed: dict[str, set[str]] | None = None) -> list[str]:
    bad = []
    for path in modules(sub):
        for name in sorted(imported(path)):
            for f in forbidden:
                if (name == f or name.startswith(f + ".")) and rel(path) not in (allowed or {}).get(f, set()):
                    bad.append(f"kvfs/{rel(path)} imports {name}")
    return bad


def test_store_does_not_import_the_layers_above_it():
    bad = offenders("store", ("kvfs.kv", "kvfs.cli", "kvfs.fs", "kvfs.daemon", "kvfs.integrations"))
    assert not bad, "the store imports a layer above it:\n" + "\n".join(bad)


def test_kv_layer_does_not_import_the_daemon_side():
    bad = offenders("kv", ("kvfs.store", "kvfs.fs", "kvfs.daemon", "kvfs.cli"))
    assert not bad, "the KV layer imports the daemon's internals:\n" + "\n".join(bad)


def test_no_file_over_the_line_limit():
    big = [f"kvfs/{rel(p)}: {n} lines" for p in modules() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, f"files over {MAX_FILE_LINES} lines (split them along their concerns):\n" + "\n".join(big)


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    return [f"kvfs/{rel(path)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_over_the_line_limit():
    long = [f for p in modules() for f in long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_no_task_outside_a_nursery():
    found = [f"kvfs/{rel(p)}:{n.lineno}" for p in modules() for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "spawn_system_task"]
    assert not found, "spawn_system_task outlives shutdown; start the task in a nursery:\n" + "\n".join(found)


def test_control_names_are_spelled_only_in_protocol():
    found = [f"kvfs/{rel(p)}:{n.lineno}: {n.value!r}" for p in modules() if rel(p) != "protocol.py"
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Constant) and n.value in (".kvfs", b".kvfs", "user.kvfs.backing")]
    assert not found, "use kvfs.protocol's names:\n" + "\n".join(found)


def test_the_checks_see_the_package():
    """The checks above would pass vacuously on an empty or moved tree."""
    assert len(modules("store")) >= 10 and len(modules("kv")) >= 5
    assert long_functions(PKG / "remote" / "queue.py", limit=40) != []
    assert "kvfs.blockformat.parse_block_header" in imported(PKG / "store" / "sniff.py")
    assert offenders("store", ("kvfs.blockformat",)) == ["kvfs/store/sniff.py imports kvfs.blockformat",
                                                        "kvfs/store/sniff.py imports kvfs.blockformat.parse_block_header"]


def test_tests_do_not_edit_the_import_path():
    """Shared helpers are found through pyproject's pytest ``pythonpath``, not ``sys.path`` edits
    (tests/integration/released.py alone puts the released runtime wheels on the path)."""
    tests = PKG.parent / "tests"
    found = [f"{p.relative_to(tests)}:{n.lineno}" for p in sorted(tests.rglob("*.py"))
             if p.relative_to(tests).as_posix() != "integration/released.py"
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "insert" and isinstance(n.value, ast.Attribute)
             and n.value.attr == "path"]
    assert not found, "sys.path edited in tests:\n" + "\n".join(found)


def test_no_test_module_imports_another():
    """Helpers live in helper modules (conftest, storekit, mounthelp, sharekit, ...), not in
    test modules: importing a test module runs its tests' module-level code twice."""
    tests = PKG.parent / "tests"
    found = [f"{p.relative_to(tests)}:{n.lineno}" for p in sorted(tests.rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.ImportFrom) and n.module
             and (n.module.startswith("tests.") or n.module.rsplit(".", 1)[-1].startswith("test_"))]
    assert not found, "a test module imported by another:\n" + "\n".join(found)


def test_fs_goes_through_cache_only():
    """The fs layer asks ``Cache``; it does not reach past it into the namespace or index."""
    def via_cache(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "cache") or (isinstance(n, ast.Attribute) and n.attr == "cache")
    found = [f"kvfs/{rel(p)}:{n.lineno} .{n.attr}" for p in modules("fs") for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr in ("ns", "index") and via_cache(n.value)]
    assert not found, "fs reaches past Cache:\n" + "\n".join(found)
