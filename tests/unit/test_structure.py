"""The package's shape, checked from the source with ``ast`` (no imports, no kernel).

Each concern has one home: the store does not reach up into the KV layer, the CLI or the fs
handlers; the KV layer does not reach into the daemon's internals; the names the daemon and
its clients agree on are spelled only in kvfs/protocol.py; background work runs in nurseries.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kvfs"
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
    (tests/support/released.py alone puts the released runtime wheels on the path)."""
    tests = PKG.parent / "tests"
    found = [f"{p.relative_to(tests)}:{n.lineno}" for p in sorted(tests.rglob("*.py"))
             if p.relative_to(tests).as_posix() != "support/released.py"
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "insert" and isinstance(n.value, ast.Attribute)
             and n.value.attr == "path"]
    assert not found, "sys.path edited in tests:\n" + "\n".join(found)


def test_no_test_module_imports_another():
    """Helpers live in the support package (tests/support: mount, files, store, ...), not in
    test modules: importing a test module runs its tests' module-level code twice."""
    tests = PKG.parent / "tests"
    found = [f"{p.relative_to(tests)}:{n.lineno}" for p in sorted(tests.rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.ImportFrom) and n.module
             and (n.module.startswith("tests.") or n.module.rsplit(".", 1)[-1].startswith("test_"))]
    assert not found, "a test module imported by another:\n" + "\n".join(found)


def test_fs_goes_through_the_store_only():
    """The fs layer asks ``Store`` (and its members); it does not reach past it into the
    namespace or index."""
    def via_store(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id == "store") or (isinstance(n, ast.Attribute) and n.attr == "store")
    found = [f"kvfs/{rel(p)}:{n.lineno} .{n.attr}" for p in modules("fs") for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr in ("ns", "index") and via_store(n.value)]
    assert not found, "fs reaches past Store:\n" + "\n".join(found)


def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class defined in kvfs/, by name: ``[(module path, its ClassDef), ...]``."""
    out: dict[str, list] = {}
    for p in modules():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef):
                out.setdefault(n.name, []).append((rel(p), n))
    return out


def _base_name(b: ast.expr) -> str:
    """A base class's own name (``mod.Base``: Base)."""
    return b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else ast.unparse(b)


def _assigns_self_state(cls: ast.ClassDef) -> bool:
    """Whether a method of ``cls`` assigns ``self.<attr>`` (state of its own)."""
    for f in cls.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or not f.args.args:
            continue
        me = f.args.args[0].arg
        for n in ast.walk(f):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == me:
                        return True
    return False


def test_no_stateful_mixins():
    """A class of kvfs/ with more than one base has no kvfs-defined base that keeps state of
    its own (assigns ``self.<attr>``): concerns that share one object's state are members
    (composition, explicit constructor arguments), not mixins reaching into a shared ``self``."""
    classes = _classes()
    found = []
    for name, defs in classes.items():
        for path, cls in defs:
            if len(cls.bases) < 2:
                continue
            for b in cls.bases:
                for bpath, bcls in classes.get(_base_name(b), []):
                    if _assigns_self_state(bcls):
                        found.append(f"kvfs/{path}:{cls.lineno} {name}: base {bcls.name} (kvfs/{bpath}) keeps state")
    assert not found, "stateful mixins:\n" + "\n".join(found)


def test_store_classes_are_composed():
    """No class in kvfs/store has more than one kvfs-defined base; ``Store`` (the fs layer's
    entry point) has none: its concerns are members (kvfs/store/store.py)."""
    classes = _classes()
    found = []
    for name, defs in classes.items():
        for path, cls in defs:
            kvfs_bases = [b for b in cls.bases if _base_name(b) in classes]
            if path.startswith("store/") and len(kvfs_bases) > 1:
                found.append(f"kvfs/{path}:{cls.lineno} {name}{tuple(map(_base_name, kvfs_bases))}")
            if name == "Store" and path == "store/store.py" and cls.bases:
                found.append(f"kvfs/{path}:{cls.lineno} Store has bases {tuple(map(_base_name, cls.bases))}")
    assert not found, "classes assembled from kvfs bases:\n" + "\n".join(found)
    assert any(p == "store/store.py" for p, _ in classes.get("Store", [])), "kvfs/store/store.py defines Store"


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions, methods and classes, and every name or
    attribute it assigns."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
    return out


def private_uses(path: Path) -> list[tuple[str, str]]:
    """``(module, "x._name")`` for each ``x._name`` in ``path`` where ``x`` is not ``self`` or
    ``cls`` and nothing in the module defines ``_name``: another module's private name."""
    tree = ast.parse(path.read_text())
    own = defined_names(tree)
    return [(rel(path), ast.unparse(n)) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and private(n.attr) and n.attr not in own
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


# What is left, with why. Not a place for new entries: give the name a public spelling instead.
PRIVATE_USES_ALLOWED = {
    ("cli/mounting.py", "os._exit"): "the standard library's own spelling",
}


def test_no_private_name_used_across_modules():
    """A module uses another module's ``_private`` names only through that module's public ones."""
    found = sorted({u for p in modules() for u in private_uses(p)} - set(PRIVATE_USES_ALLOWED))
    assert not found, "another module's private name used:\n" + "\n".join(f"kvfs/{m}: {e}" for m, e in found)
    stale = set(PRIVATE_USES_ALLOWED) - {u for p in modules() for u in private_uses(p)}
    assert not stale, f"allowed but no longer used (drop them from the list): {sorted(stale)}"


# the store, the fs layer's Store and its members, as the code names them
HOOK_HOLDERS = ("store", "kvstore", "files", "names", "commits", "leases", "xattrs", "owners", "gets")


def hook_assignments(path: Path) -> list[tuple[str, str, int]]:
    """``(attr, target, line)`` of each ``<x>.on_* = ...`` in ``path`` whose object is one of
    ``HOOK_HOLDERS`` (a name or an attribute of that name) other than ``self``."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr.startswith("on_"):
            v = n.value
            holder = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            if holder in HOOK_HOLDERS:
                out.append((n.attr, ast.unparse(n), n.lineno))
    return out


def hook_owners() -> dict[str, set[str]]:
    """Each ``on_*`` hook and the modules that give it its default (``self.on_x = ...``)."""
    owners: dict[str, set[str]] = {}
    for p in modules():
        for n in ast.walk(ast.parse(p.read_text())):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr.startswith("on_")
                    and isinstance(n.value, ast.Name) and n.value.id == "self"):
                owners.setdefault(n.attr, set()).add(rel(p))
    return owners


# The store wiring its own parts (Namespace is made inside Store, in kvfs/store/store.py).
HOOKS_ALLOWED = {("store/namespace.py", "store.on_lost"), ("store/namespace.py", "store.on_materialize"),
                 *(("store/store.py", f"self.{m}.on_renamed") for m in ("names", "files", "commits"))}


def test_hooks_are_set_by_the_composition_root():
    """``store.on_*`` / ``kvstore.files.on_*`` hooks are set by kvfs/build.py (or the object's own
    module), not by another package's code that happens to hold the object."""
    owners = hook_owners()
    found = [f"kvfs/{rel(p)}:{line} {target}" for p in modules() if rel(p) != "build.py"
             for attr, target, line in hook_assignments(p)
             if rel(p) not in owners.get(attr, set()) and (rel(p), target) not in HOOKS_ALLOWED]
    assert not found, "a hook set outside kvfs/build.py:\n" + "\n".join(found)
    assert hook_assignments(PKG / "build.py"), "the check no longer sees kvfs/build.py's hooks"


def test_one_composition_root():
    """kvfs/build.py alone turns a Config into tiers, the store's facade, the fs layer and
    their hooks: fsck is handed what it checks, the tiers are built from plain arguments, the
    config reads no tier module, and the fs layer takes the root inode from kvfs.protocol."""
    bad = offenders("store", ("kvfs.build", "kvfs.config")) + offenders("remote", ("kvfs.build", "kvfs.config"))
    bad += [f"kvfs/config.py imports {n}" for n in sorted(imported(PKG / "config.py")) if n.startswith("kvfs.store")]
    bad += offenders("fs", ("kvfs.store.index",))
    assert not bad, "past the composition root:\n" + "\n".join(bad)
    made: dict[str, set[str]] = {}
    callers = [*sorted((PKG.parent / "tests").rglob("*.py")), *sorted((PKG.parent / "benchmarks").rglob("*.py"))]
    for p in [*modules(), *callers]:
        for n in ast.walk(ast.parse(p.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in ("Store", "KvfsOperations", "SharedNames")):
                made.setdefault(n.func.id, set()).add(p.relative_to(PKG.parent).as_posix())
    assert made == {k: {"kvfs/build.py"} for k in ("Store", "KvfsOperations", "SharedNames")}, made


def test_control_answers_are_encoded_in_protocol():
    """The control files' requests are parsed and their answers encoded in kvfs/protocol.py: the
    fs layer and the store's lease and get answers build no JSON or answer layout themselves."""
    found = [f"kvfs/{rel(p)} imports {n}" for p in [*modules("fs"), PKG / "store" / "leases.py",
                                                     PKG / "store" / "getbatch.py"]
             for n in sorted(imported(p)) if n == "json" or n.startswith("json.")]
    found += [f"kvfs/{rel(p)}:{n.lineno} .{n.attr}" for p in [*modules("fs"), PKG / "store" / "getbatch.py"]
              for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.Attribute) and n.attr in ("GET_HEAD", "GET_ENTRY", "GET_MAGIC")]
    assert not found, "a control file's wire format outside kvfs/protocol.py:\n" + "\n".join(found)


MAX_CLASS_METHODS = 30
# Classes over the limit, with why. Not a place for new entries: split the class along its concerns.
BIG_CLASSES_ALLOWED: dict[str, str] = {}


def methods_of(cls: ast.ClassDef) -> int:
    """Methods defined in the class body itself (not in nested classes or functions)."""
    return sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in cls.body)


def test_no_class_over_the_method_limit():
    """A class with more than MAX_CLASS_METHODS methods holds several concerns: they become
    members (composed objects with explicit constructor arguments)."""
    found = [f"kvfs/{path}:{cls.lineno} {name}: {n} methods" for name, defs in _classes().items()
             for path, cls in defs if (n := methods_of(cls)) > MAX_CLASS_METHODS
             and f"{path}:{name}" not in BIG_CLASSES_ALLOWED]
    assert not found, f"classes over {MAX_CLASS_METHODS} methods (split them):\n" + "\n".join(found)


def package_of(module: str) -> str:
    """``kvfs.store.index``: ``store``; a top-level module is a package of its own
    (``kvfs.daemon``: ``daemon``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def _root(e: ast.expr) -> str | None:
    """The name an expression starts from (``ops.kernel.start(...)``: ``ops``)."""
    while isinstance(e, (ast.Attribute, ast.Subscript, ast.Call)):
        e = e.func if isinstance(e, ast.Call) else e.value
    return e.id if isinstance(e, ast.Name) else None


def foreign_names(tree: ast.AST, own: str) -> set[str]:
    """Names in a module of package ``own`` that stand for another kvfs package's objects:
    what it imports from another package, parameters annotated with such a name, and names
    bound (``=``, ``with ... as``) to a call of, or an attribute of, such a name."""
    foreign = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and n.module.startswith("kvfs."):
            if package_of(n.module) != own:
                foreign.update(a.asname or a.name for a in n.names)
        elif isinstance(n, ast.Import):
            foreign.update(a.asname or a.name.split(".")[0] for a in n.names
                           if a.name.startswith("kvfs.") and package_of(a.name) != own)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            foreign.update(a.arg for a in n.args.args + n.args.kwonlyargs if a.annotation is not None
                           and any(isinstance(x, ast.Name) and x.id in foreign for x in ast.walk(a.annotation)))
    grew = True
    while grew:
        grew = False
        for n in ast.walk(tree):
            pairs = ([(t, n.value) for t in n.targets] if isinstance(n, ast.Assign) else
                     [(i.optional_vars, i.context_expr) for i in n.items if i.optional_vars is not None]
                     if isinstance(n, (ast.With, ast.AsyncWith)) else [])
            for t, v in pairs:
                if (isinstance(t, ast.Name) and t.id not in foreign and isinstance(v, (ast.Call, ast.Attribute))
                        and _root(v) in foreign):
                    foreign.add(t.id)
                    grew = True
    return foreign


def foreign_attribute_sets(source: str, module: str) -> list[str]:
    """``line: target`` of each ``x.attr = ...`` (or ``x.a.b = ...``, ``+=``, a tuple's part)
    in ``source`` (the module ``module``) where ``x`` is one of its :func:`foreign_names`."""
    tree = ast.parse(source)
    foreign = foreign_names(tree, package_of(module))
    found = []
    for n in ast.walk(tree):
        targets = (n.targets if isinstance(n, ast.Assign) else
                   [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and _root(e) in foreign:
                    found.append(f"{n.lineno}: {ast.unparse(e)}")
    return found


def test_no_attribute_set_on_another_packages_object():
    """Outside kvfs/build.py (the composition root), a module sets no attribute of an object
    of another kvfs package that it imported, built or was handed as that package's type: the
    wiring between packages is the root's (or a constructor argument), and a package changes
    its own objects through their methods. (Objects reached through ``self`` or untyped
    parameters are not seen; top-level modules count as packages of their own.)"""
    found = [f"kvfs/{rel(p)}:{hit}" for p in modules() if rel(p) != "build.py"
             for hit in foreign_attribute_sets(p.read_text(), "kvfs." + rel(p)[:-3].replace("/", "."))]
    assert not found, "an attribute of another package's object set outside kvfs/build.py:\n" + "\n".join(found)
    sample = ("from kvfs.store.index import Index\nfrom kvfs.build import build_ops\n"
              "def serve(cfg, kvstore):\n    index = Index(cfg.state_dir)\n    index.names = names = None\n"
              "    ops = build_ops(kvstore, None)\n    ops.notifier.direct = None\n    ops.kernel.start(None)\n")
    assert foreign_attribute_sets(sample, "kvfs.daemon") == ["5: index.names", "7: ops.notifier.direct"]
    assert foreign_attribute_sets(sample.replace("kvfs.store.index", "kvfs.daemon"), "kvfs.daemon") == [
        "7: ops.notifier.direct"]


def record_fields() -> set[str]:
    """The field names of index records: the keys of INODE_FIELDS and OBJECT_FIELDS in
    kvfs/store/records.py (read from its source)."""
    out = set()
    for n in ast.walk(ast.parse((PKG / "store" / "records.py").read_text())):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("INODE_FIELDS", "OBJECT_FIELDS")
                                             for t in n.targets):
            out.update(k.value for d in ast.walk(n.value) if isinstance(d, ast.Dict)
                       for k in d.keys if isinstance(k, ast.Constant))
    return out


# what the code calls a record it holds (an attribute of that name counts too)
RECORD_NAMES = {"rec", "record", "r", "prec", "orec", "trec", "irec", "inode_rec", "orphan"}
RECORD_HOMES = {"store/index.py", "store/records.py"}
# modules whose ``r`` is a row of a table the CLI prints (JSON from a mount), never an index record
TABLE_ROWS = {"cli/inspect.py", "cli/bench_report.py"}


def string_keyed_records(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` of each ``rec["mode"]``, ``rec.get("oid")`` and ``"kv" in rec`` in
    ``source``, where ``rec`` is a name (or attribute) in RECORD_NAMES and the string is a
    record field name."""
    def is_record(e: ast.expr) -> bool:
        return (isinstance(e, ast.Name) and e.id in RECORD_NAMES) or (
            isinstance(e, ast.Attribute) and e.attr in RECORD_NAMES)

    def field(e: ast.expr) -> bool:
        return isinstance(e, ast.Constant) and e.value in fields

    out = []
    for n in ast.walk(ast.parse(source)):
        if ((isinstance(n, ast.Subscript) and is_record(n.value) and field(n.slice))
                or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("get", "pop")
                    and is_record(n.func.value) and n.args and field(n.args[0]))
                or (isinstance(n, ast.Compare) and field(n.left) and len(n.ops) == 1
                    and isinstance(n.ops[0], (ast.In, ast.NotIn)) and is_record(n.comparators[0]))):
            out.append((n.lineno, ast.unparse(n)))
    return out


def test_records_are_read_by_attribute():
    """Index records are typed (kvfs/store/records.py: InodeRecord, ObjectRecord): outside the
    index and the records module nothing reads one by a string key
    (``rec["mode"]``, ``rec.get("oid")``, ``"kv" in rec``: a KeyError at run time on a typo).
    The check goes by name: a variable or attribute named as in RECORD_NAMES, subscripted or
    asked with a string that is a record field name; a record under another name is not seen."""
    fields = record_fields()
    assert {"mode", "oid", "xattrs", "place", "chunk_size"} <= fields, fields
    found = [f"kvfs/{rel(p)}:{line} {text}" for p in modules() if rel(p) not in RECORD_HOMES | TABLE_ROWS
             for line, text in string_keyed_records(p.read_text(), fields)]
    assert not found, "a record read by a string key (use its attribute):\n" + "\n".join(found)
    probe = 'rec["mode"]; self.prec.get("oid"); "kv" in orec; row["mode"]; rec["other"]; rec.mode'
    assert [t for _, t in string_keyed_records(probe, fields)] == [
        "rec['mode']", "self.prec.get('oid')", "'kv' in orec"], "the check no longer sees record reads"
    rows = [p for p in TABLE_ROWS if string_keyed_records((PKG / p).read_text(), fields)]
    assert sorted(rows) == sorted(TABLE_ROWS), f"no longer reads rows named like records: {set(TABLE_ROWS) - set(rows)}"
