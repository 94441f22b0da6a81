"""scripts/profile_stage_batch.py, the where-does-a-batched-forward's-time-go profile, on the CPU.

Bug guarded (issue 21): the profile a GPU session runs in its few minutes must run and count
what it says: per row count a wall time, the host's part, and the ops the forward issued,
more of them for more jobs (attention runs per job), none of them kernel launches on a CPU;
and its attention microbenchmark times two paths that compute the same thing.
"""

from __future__ import annotations

import json

from scripts import profile_stage_batch as script


def test_the_profile_runs_on_the_cpu_and_counts_ops_per_job(tmp_path):
    out = tmp_path / "profile.json"
    assert script.main(["--rows", "1,4", "--reps", "1", "--stand-in", "--attention", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smollm2-shapes" and report["layers"] == 10
    one, four = report["levels"]
    assert one["rows"] == 1 and four["rows"] == 4
    assert all(m["wall_ms"] > 0 and 0 < m["host_ms"] <= m["wall_ms"] * 1.5 and m["kernel_launches"] == 0 for m in (one, four))
    assert four["ops"] > one["ops"] > 10 * 10  # ten layers of several ops each; attention adds some a job
    assert any("attention" in op for op in four["top_host_self_ms"])
    # --attention: both paths timed, and they compute the same attention (the padded keys masked out)
    assert [a["jobs"] for a in report["attention"]] == [1, 4]
    assert all(a["loop_ms"] > 0 and a["padded_ms"] > 0 and a["largest_difference"] < 1e-5 for a in report["attention"])
