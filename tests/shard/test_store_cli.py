"""`shard-node prepare`: exit codes and one-line errors, the idempotent second run."""

from __future__ import annotations

import pytest

from shard.cli import main
from shard.manifest import layer_file


def test_prepare_then_rerun_does_nothing(tiny_llama, tmp_path, capsys):
    # Bug guarded: a re-run silently rebuilding (or failing on) an existing store. Sound:
    # the second run's message and the unchanged mtimes both say nothing was rewritten.
    out = tmp_path / "store"
    assert main(["prepare", "--model", str(tiny_llama.path), "--out", str(out), "--quiet"]) == 0
    first = capsys.readouterr().out
    assert first.startswith(f"prepared {tiny_llama.path.name} (llama, 5 layers, F32) at {out}")
    mtime = (out / layer_file(0)).stat().st_mtime_ns
    assert main(["prepare", "--model", str(tiny_llama.path), "--out", str(out), "--quiet"]) == 0
    second = capsys.readouterr().out
    assert "already prepared, digests verified, nothing to do" in second
    assert first.splitlines()[-1] == second.splitlines()[-1]  # the same digest line
    assert (out / layer_file(0)).stat().st_mtime_ns == mtime


def test_default_out_is_under_shard_home(tiny_llama, tmp_path, monkeypatch, capsys):
    # Bug guarded: ignoring SHARD_HOME (tests and users writing into the real home cache).
    monkeypatch.setenv("SHARD_HOME", str(tmp_path / "home"))
    assert main(["prepare", "--model", str(tiny_llama.path), "--quiet"]) == 0
    assert (tmp_path / "home" / "models" / tiny_llama.path.name / "manifest.json").is_file()
    capsys.readouterr()


@pytest.mark.parametrize("case", ["unsupported", "missing", "corrupt", "not_empty"])
def test_errors_are_one_line_without_traceback(case, tiny_model_factory, tmp_path, capsys):
    # Bug guarded: a user-facing failure printing a traceback, or exiting 0. Sound: checks
    # the exit status and that stderr is exactly one line naming the cause.
    out = tmp_path / "store"
    model = str(tiny_model_factory("llama").path)
    if case == "unsupported":
        model, expected = str(tiny_model_factory("gpt2").path), "unsupported model family: 'gpt2'"
    elif case == "missing":
        model, expected = str(tmp_path / "nowhere"), "no such model"
    elif case == "corrupt":
        assert main(["prepare", "--model", model, "--out", str(out), "--quiet"]) == 0
        path = out / layer_file(3)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        expected = "digest mismatch for layers/00003.safetensors"
    else:
        out.mkdir()
        (out / "unrelated.txt").write_text("mine")
        expected = "is not empty and holds no manifest.json"
    capsys.readouterr()
    assert main(["prepare", "--model", model, "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("shard-node prepare: error: ") and expected in err


def test_force_rebuilds_a_corrupt_store(tiny_llama, tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["prepare", "--model", str(tiny_llama.path), "--out", str(out), "--quiet"]) == 0
    (out / layer_file(1)).write_bytes(b"junk")
    assert main(["prepare", "--model", str(tiny_llama.path), "--out", str(out), "--quiet", "--force"]) == 0
    assert "prepared" in capsys.readouterr().out
    assert main(["prepare", "--model", str(tiny_llama.path), "--out", str(out), "--quiet"]) == 0


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    capsys.readouterr()
