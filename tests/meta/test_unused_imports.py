"""No runtime module imports a name it does not use (pyflakes' F401, without its noqa escape).

Bug guarded: a module keeping an import only so others can import the name through it (a
re-export, e.g. shard.node once re-exported shard.assignment_rules.public_key_of_peer), which
ties importers to a heavy module for a light helper and hides where the name lives; and plain
leftovers after a refactor. Package __init__ modules are exempt: exporting is their job.
Sound: parses every module of shard/ and coordinator/; a name counts as used where the module
reads it (ast.Name) or names it in a string (string annotations, __all__)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def unused_imports(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    bound: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name.split(".")[0]] = node.lineno
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(re.findall(r"[A-Za-z_]\w*", node.value))
    return sorted((line, name) for name, line in bound.items() if name not in used)


def test_the_check_sees_an_unused_import():
    # Guards the guard: a re-export kept under a noqa comment is still found.
    src = "from a import used, kept  # noqa: F401 (re-exported)\nimport b.c\nx: 'Later' = used(b)\n"
    assert unused_imports(src) == [(1, "kept")]


def test_runtime_modules_have_no_unused_imports():
    bad = []
    for pkg in ("shard", "coordinator"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name != "__init__.py":
                bad += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in unused_imports(path.read_text())]
    assert not bad, bad
