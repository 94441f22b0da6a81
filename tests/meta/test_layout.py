"""Guards the package dependency direction, the coordinator's wings, the absence of
import cycles, the data-only rule (DESIGN.md) and the module line budget (STYLE.md)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
# receipts -> shard -> ring -> coordinator: each may import only those to its left.
ORDER = ["receipts", "shard", "ring", "coordinator"]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_packages_import_only_to_their_left():
    # Bug guarded: a lower layer (e.g. receipts) growing a dependency on a higher one,
    # which would drag torch/networking into pure code. Sound: parses every import.
    bad = []
    for i, pkg in enumerate(ORDER):
        forbidden = set(ORDER[i + 1 :])
        for path in (ROOT / pkg).rglob("*.py"):
            hits = _imports(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, bad


UNSAFE = re.compile(
    r"^\s*(import pickle|from pickle|import dill|import cloudpickle|import marshal)|pickle\.loads?\(|"
    r"(?<![.\w])eval\(|(?<![.\w])exec\(|torch\.load\((?![^)]*weights_only=True)"
)


def test_no_unsafe_deserialisation_in_runtime_code():
    # Bug guarded: a peer-reachable path that unpickles or evals bytes. Sound: scans every
    # runtime module line by line; the regex is tested below so it cannot silently miss.
    bad = []
    for pkg in ORDER:
        for path in (ROOT / pkg).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if UNSAFE.search(line):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, bad


def test_unsafe_pattern_catches_what_it_should():
    for line in ["import pickle", "x = pickle.loads(b)", "eval(s)", "torch.load(f)", "exec(code)"]:
        assert UNSAFE.search(line), line
    for line in ["torch.load(f, weights_only=True)", "evaluate(x)", "self.executor", "model.eval()"]:
        assert not UNSAFE.search(line), line


# STYLE.md: a module has one responsibility and aims under ~400 lines; a module past it
# does too much and wants splitting, not a raised cap.
MODULE_LINE_BUDGET = 400


def test_every_module_stays_within_the_line_budget():
    # Bug guarded: a module quietly growing into several responsibilities (three passed
    # 400 lines one edit at a time). Sound: counts every line of every runtime module
    # and script.
    over = [f"{path.relative_to(ROOT)}: {n} lines" for pkg in [*ORDER, "scripts"]
            for path in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MODULE_LINE_BUDGET]
    assert not over, f"over the {MODULE_LINE_BUDGET}-line budget: {over}"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in ORDER for p in sorted((ROOT / pkg).rglob("*.py"))}


def _module_edges(path: pathlib.Path, known: set[str]) -> set[str]:
    """Every runtime module this file imports, wherever the import statement stands
    (TYPE_CHECKING blocks and function bodies too: a hidden loop is still a loop). `from
    pkg import name` is an edge to pkg.name when that is a module, else to pkg."""
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            edges.update(subs)
            if len(subs) < len(node.names):
                edges.add(node.module)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            visit(v)
    return out


def test_no_import_cycle_among_runtime_modules():
    # Bug guarded: two modules that need each other (ring_engine <-> ring_job was one,
    # hidden behind TYPE_CHECKING), which makes neither testable alone. Sound: every
    # import statement of every runtime module is an edge; the cycle finder is tested below.
    modules = _runtime_modules()
    graph = {name: _module_edges(path, set(modules)) - {name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_what_it_should():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


WINGS = ["spec", "swarm", "trust", "jobs", "gateway"]


def _declared_imports(wing: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((ROOT / "coordinator" / wing / "__init__.py").read_text())) or ""
    match = re.search(r"^Imports: (.*?)\.?$", doc, re.M)
    assert match, f"coordinator/{wing}/__init__.py must say which wings it imports ('Imports: ...')"
    return {name.strip() for name in match.group(1).split(",")}


def test_each_coordinator_wing_imports_only_what_its_docstring_says():
    # Bug guarded: a wing reaching up a floor (the jobs wing importing the HTTP gateway, the
    # speculation core importing the ring), which the README's map would then misdescribe.
    # Sound: every coordinator import of every module in the wing is checked against the
    # wing's own "Imports:" line; the top-level modules (server, cli) assemble and are free.
    bad = []
    for wing in WINGS:
        allowed = _declared_imports(wing) | {f"coordinator.{wing}"}
        for path in sorted((ROOT / "coordinator" / wing).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                for name in names:
                    if name == "coordinator" or name.startswith("coordinator."):
                        owner = ".".join(name.split(".")[:2])
                        if owner not in allowed:
                            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_every_wing_is_named_in_the_package_docstring():
    doc = ast.get_docstring(ast.parse((ROOT / "coordinator" / "__init__.py").read_text()))
    wings = {p.name for p in (ROOT / "coordinator").iterdir() if (p / "__init__.py").exists()}
    assert wings == set(WINGS)
    assert all(f"`coordinator.{w}`" in doc for w in WINGS)


def test_the_readme_module_map_names_every_runtime_module_once():
    # Bug guarded: a module added or moved without its line in the README's map, so a
    # newcomer cannot find a behaviour from the map in one hop (the re-layout left six
    # stale paths). Sound: every runtime module file is compared with the map's rows both
    # ways; package __init__ files describe their wing instead and are not rows.
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Module map"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M)
    modules = {str(p.relative_to(ROOT)) for pkg in ORDER for p in (ROOT / pkg).rglob("*.py") if p.name != "__init__.py"}
    assert sorted(modules - set(rows)) == [], "modules missing from the README module map"
    assert sorted(set(rows) - modules) == [], "README module map rows naming no module"
    assert len(rows) == len(set(rows)), "a module has two rows"


def test_test_modules_have_unique_basenames():
    # Bug guarded: two test files with one basename in different folders (tests/ has no
    # __init__ files, so pytest imports them by basename) stop the whole collection; each
    # passed when run alone. Sound: lists every test module under tests/.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
