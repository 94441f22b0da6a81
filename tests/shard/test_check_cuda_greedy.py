"""scripts/check_cuda_greedy.py, the GPU check that batched greedy outputs equal each job alone, run on the CPU.

Bug guarded (issue 21): the check a GPU session runs must run, and must tell a differing
job from an equal one. Sound: on the CPU batched and alone are bitwise equal
(tests/shard/test_stage_batch*.py), so the self-test must pass with every job equal and
logits equal; a planted difference must be found at its step, with the logits compared
only while both runs had the same input.
"""

from __future__ import annotations

import json

import torch

from scripts import check_cuda_greedy as script


def test_the_check_passes_on_the_cpu_with_every_job_equal(tmp_path):
    out = tmp_path / "greedy.json"
    assert script.main(["--device", "cpu", "--model", "tiny", "--jobs", "8", "--tokens", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["differing"] == [] and len(report["jobs"]) == 8
    assert len(set(report["prompt_tokens"].values())) >= 5  # ragged prompts, short and long
    assert all(r["first_difference"] is None and r["largest_logit_difference"] == 0.0 for r in report["jobs"].values())


def test_compare_finds_the_first_differing_step():
    rows = [torch.tensor([0.0, 1.0, 0.5]), torch.tensor([2.0, 0.0, 1.9]), torch.tensor([0.0, 3.0, 1.0])]
    alone = {"a": ([1, 0, 1], rows), "b": ([1, 0, 1], rows)}
    moved = [rows[0], rows[1] + torch.tensor([0.0, 0.0, 0.2]), rows[2] + 5.0]  # step 1 flips to token 2; step 2 is another input
    batched = {"a": ([1, 2, 1], moved), "b": ([1, 0, 1], rows)}
    report = script.compare(batched, alone)
    assert report["a"]["first_difference"] == 1 and abs(report["a"]["largest_logit_difference"] - 0.2) < 1e-6
    assert report["b"]["first_difference"] is None and report["b"]["largest_logit_difference"] == 0.0
    assert abs(report["b"]["smallest_top2_gap_alone"] - 0.1) < 1e-6  # step 1: 2.0 against 1.9
