"""Benchmark results name the commit they ran, from a checkout or from a `git archive`
snapshot (scripts/bench_ringkit.git_revision).

Bug guarded: benchmarks run from `git archive` snapshots (so that edits in the checkout do
not change a run) recorded an empty git_revision, and each result's revision had to be
written in by hand afterwards.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from scripts.bench_ringkit import git_revision

ROOT = Path(__file__).resolve().parents[2]


def git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True).stdout


def test_an_archive_of_head_carries_its_commit_and_git_revision_reads_it(tmp_path):
    head = git("rev-parse", "--short", "HEAD").decode().strip()
    assert git_revision().removesuffix("+dirty") == head  # in the checkout: git itself
    with tarfile.open(fileobj=io.BytesIO(git("archive", "HEAD", "scripts/revision.txt"))) as tar:
        tar.extractall(tmp_path, filter="data")
    assert git_revision(str(tmp_path / "scripts")) == head  # in a snapshot: what the archive wrote


def test_a_copy_that_no_archive_filled_in_names_no_commit(tmp_path):
    (tmp_path / "revision.txt").write_text((ROOT / "scripts" / "revision.txt").read_text())
    assert git_revision(str(tmp_path)) == ""
    assert git_revision(str(tmp_path / "missing")) == ""
