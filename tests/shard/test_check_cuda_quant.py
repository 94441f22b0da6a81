"""scripts/check_cuda_quant.py, the GPU check for weight-only quantisation, run on the CPU.

Bug guarded: the check a GPU session runs must run, and its stage step must build the depth
it is asked for (an int4 stage's cross-device error grows with depth: an H200 found 2 layers
already past the CPU auditor's tolerance, docs/quantisation.md). Sound: CPU against CPU the
stages are bitwise equal, so every scheme passes with no outlier, at the asked depth.
"""

from __future__ import annotations

import json

from scripts import check_cuda_quant as script


def test_the_stage_step_runs_at_the_asked_depth_on_the_cpu(tmp_path):
    out = tmp_path / "quant.json"
    assert script.main(["--device", "cpu", "--only-stage", "--stage-layers", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["stage_layers"] == 3
    for name in ("none", "int8", "int4"):
        assert report[f"stage_{name}_max_err_over_row_rms"] == 0.0 and report[f"stage_{name}_audit_outlier_fraction"] == 0.0
    assert not any(key.startswith("speed_") for key in report)  # --only-stage: step 4 alone, no speed step
