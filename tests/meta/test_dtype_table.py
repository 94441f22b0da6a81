"""Guards DESIGN.md's "one dtype table, every other map derived from it": no module keeps
its own map of dtype names, and what others derive (CLI names, compute dtypes, audit
tolerances) follows the table's rows."""

import ast
import dataclasses
import pathlib

import pytest

from coordinator.trust.tolerance import TOLERANCES, wire_tolerance
from shard.wire.dtypes import (ACTIVATION_NAMES, BY_CLI_NAME, BY_NAME, COMPUTE_DTYPES, DTYPES, from_cli_name)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "shard" / "wire" / "dtypes.py"
# receipts cannot import shard (DESIGN.md's dependency direction), so its byte reader
# names numpy's dtypes itself; it is the one exception.
EXEMPT = {TABLE, ROOT / "receipts" / "spotcheck.py"}
# Every spelling of a float dtype the table knows: wire names, CLI names, torch names.
NAMES = {d.name for d in DTYPES} | set(BY_CLI_NAME) | {d.torch_name for d in DTYPES}


def _dtype_maps(path: pathlib.Path) -> list[str]:
    """Dict displays keyed by two or more dtype names or mapping one name to another, and
    set/tuple/list displays of two or more dtype names at module level (a table in all but
    name). A record that merely says which dtype it used ({"wire": "f32"}) is no map."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def is_name(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in NAMES

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if is_name(k)}
            if len(keys) >= 2 or any(is_name(k) and is_name(v) for k, v in zip(node.keys, node.values)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(keys)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
                isinstance(top, (ast.Assign, ast.AnnAssign)) and node is top.value for top in tree.body):
            names = {i.value for i in node.elts if is_name(i)}
            if len(names) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(names)}")
    return found


def test_no_module_outside_the_table_keeps_a_dtype_name_map():
    # Bug guarded: a shadow map ("fp8" -> "f8_e4m3fn" in the server, a tuple of wire names
    # in the codec) that drifts from the table when a row is added. Sound: every module of
    # every package and script is parsed; the detector is tested below.
    found = [hit for pkg in ["receipts", "shard", "ring", "coordinator", "scripts"]
             for path in sorted((ROOT / pkg).rglob("*.py")) if path not in EXEMPT for hit in _dtype_maps(path)]
    assert found == []


def test_the_table_name_f8_e4m3fn_is_spelled_only_in_the_table():
    # Bug guarded: code branching on one fp8 wire name instead of the row's is_fp8.
    hits = [str(p.relative_to(ROOT)) for pkg in ["receipts", "shard", "ring", "coordinator"]
            for p in sorted((ROOT / pkg).rglob("*.py")) if p != TABLE and '"f8_e4m3fn"' in p.read_text()]
    assert hits == []


def test_the_map_detector_finds_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('WIRE = {"f32": "f32", "fp8": "f8_e4m3fn"}\nNAMES = ("f32", "bf16")\nDT = {"float32": 1, "bfloat16": 2}\n')
    good = tmp_path / "good.py"
    good.write_text('def f(x):\n    return x in ("f32", "bf16")\nONE = {"f32": 4}\nRUN = {"dtype": "float32", "wire": "f32"}\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert len(_dtype_maps(bad)) == 3 and _dtype_maps(good) == []
    finally:
        ROOT = root


def test_cli_names_and_compute_dtypes_come_from_the_rows():
    assert from_cli_name("fp8") == "f8_e4m3fn" and from_cli_name("bf16") == "bf16"
    with pytest.raises(ValueError, match=r"activation dtype must be one of \['f32', 'f16', 'bf16', 'fp8'\], got 'f8'"):
        from_cli_name("f8")
    assert all(BY_NAME[row.name].is_float for row in BY_CLI_NAME.values())
    assert ACTIVATION_NAMES == ("f32", "f16", "bf16", "f8_e4m3fn", "f8_e5m2")
    assert set(COMPUTE_DTYPES) == {"float32", "float16", "bfloat16"}


def test_audit_tolerances_follow_mantissa_bits():
    # Bug guarded: a tolerance table kept apart from the dtypes, which a new or changed row
    # would silently miss (an fp8 wire audited at f32's tolerance accuses honest stages).
    # Sound: every float row gets one, each at least one step of the dtype (2^-m of an
    # element), fewer mantissa bits never tighten it, and changing a row's bits moves it.
    assert set(TOLERANCES) == {d.name for d in DTYPES if d.is_float}
    for row in DTYPES:
        if row.is_float:
            assert TOLERANCES[row.name] == wire_tolerance(row)
            assert TOLERANCES[row.name].rel_tol >= 2.0 ** -row.mantissa_bits
    for kind in (True, False):
        rows = sorted((d for d in DTYPES if d.is_float and d.is_fp8 == kind), key=lambda d: d.mantissa_bits)
        tols = [TOLERANCES[d.name] for d in rows]
        assert all(a.abs_tol >= b.abs_tol and a.rel_tol >= b.rel_tol for a, b in zip(tols, tols[1:]))
    bf16 = BY_NAME["bf16"]
    assert wire_tolerance(dataclasses.replace(bf16, mantissa_bits=6)).rel_tol == 2 * wire_tolerance(bf16).rel_tol


def test_audit_tolerances_keep_their_calibration():
    # The bounds docs/receipts.md measured honest errors against (bf16 and fp8 rings, SmolLM2).
    calibrated = {"f32": (1e-4, 1e-3), "bf16": (1e-2, 1.6e-2), "f8_e4m3fn": (2e-2, 0.13), "f8_e5m2": (4e-2, 0.26)}
    for name, (abs_tol, rel_tol) in calibrated.items():
        assert TOLERANCES[name].abs_tol == pytest.approx(abs_tol, rel=0.05)
        assert TOLERANCES[name].rel_tol == pytest.approx(rel_tol, rel=0.05)
