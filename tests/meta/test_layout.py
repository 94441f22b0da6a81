"""Guards the package dependency direction, the data-only rule (DESIGN.md) and the
module line budget (STYLE.md)."""

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


# STYLE.md: a module has one responsibility and aims under ~400 lines. The budget leaves
# room over the aim; a module past it does too much and wants splitting, not a raised cap.
MODULE_LINE_BUDGET = 450


def test_every_module_stays_within_the_line_budget():
    # Bug guarded: a module quietly growing into several responsibilities (three passed
    # 400 lines one edit at a time). Sound: counts every line of every runtime module
    # and script.
    over = [f"{path.relative_to(ROOT)}: {n} lines" for pkg in [*ORDER, "scripts"]
            for path in sorted((ROOT / pkg).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MODULE_LINE_BUDGET]
    assert not over, f"over the {MODULE_LINE_BUDGET}-line budget: {over}"
