"""scripts/check_cuda_batch.py, the prepared GPU check for batched forwards, run on the CPU.

Bug guarded (issue 21): a GPU lent for ~15 minutes finds a script that does not run, or
one that passes whatever it measures. Sound: the script runs as a GPU session would run it
(its own process, --device cpu, the tiny models) and must exit 0 with every family's and
scenario's figures in its JSON (the CPU gives batched == alone, tests/shard/test_stage_batch);
its judge must fail a batch 1e-3 off its alone states, or a job missing from the batch; its
device audit must see a float and an integer tensor copied to another device (the meta
device stands in for the host, the only other device a CPU machine has).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from scripts import check_cuda_batch as script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_check_passes_on_the_cpu_and_writes_its_figures(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, "scripts/check_cuda_batch.py", "--device", "cpu", "--no-smollm2", "--json", str(out)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all batched-forward checks passed" in run.stdout
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["device"] == "cpu"
    for family in script.TINY:
        for scenario in ("decode", "chains", "trees", "prefill", "mix"):
            assert report[f"exact_{family}_{scenario}_logits"] <= script.BOUND, (family, scenario)
        assert report[f"device_{family}_forward_batch"]["off_device"] == {}
        assert report[f"device_{family}_worker"]["ops"] > 0
    assert all(report[f"speed_llama_5layers_{rows}rows_ms"] > 0 for rows in script.SPEED_ROWS)


def test_the_judge_fails_a_batch_over_the_bound():
    script.DEVICE = "cpu"
    script.failures.clear()
    model = script.tiny_model("llama")
    alone = {"a": torch.randn(3, model.cfg.hidden_size), "b": torch.randn(1, model.cfg.hidden_size)}
    near = {name: x + 1e-7 for name, x in alone.items()}
    script.judge("near", *script.largest_differences(near, alone, model.head), script.BOUND)
    assert script.failures == []
    off = {name: x + 1e-3 for name, x in alone.items()}
    hidden, logits = script.largest_differences(off, alone, model.head)
    assert hidden >= 1e-3 * 0.99 and logits > script.BOUND
    script.judge("off", hidden, logits, script.BOUND)
    script.judge("missing", *script.largest_differences({"a": alone["a"]}, alone, model.head), None)
    assert [f.partition(":")[0] for f in script.failures] == ["exact off", "exact missing"]
    script.failures.clear()


def test_the_device_audit_sees_tensors_leave_the_device():
    script.DEVICE = "cpu"
    script.failures.clear()
    with script.DeviceAudit() as audit:
        x = torch.randn(4) * 2
        (x + 1).to("meta")  # a float copy off the device
        torch.arange(3).to("meta")  # an integer read elsewhere (the MoE router's kind)
    off, reads, onto = script.leaving(audit.ops, "cpu")
    assert off == {"aten._to_copy": 1} and reads == {"aten._to_copy": 1} and onto == {}
    script.check_audit("planted", audit, [x], moe=False)
    assert [f.partition(":")[0] for f in script.failures] == ["device planted", "device planted"]
    script.failures.clear()
    with script.DeviceAudit() as audit:  # the real forward keeps everything where it is
        model = script.tiny_model("qwen2")
        twin = script.Twin(model)
        history, rounds = script.scenarios(model.cfg, torch.Generator().manual_seed(0))["mix"]
        twin.alone(history)
        twin.batch(rounds[0])
    assert script.leaving(audit.ops, "cpu") == ({}, {}, {}) and len(audit.ops) > 1000


@pytest.mark.slow
def test_the_stand_in_has_smollm2s_shapes(smollm2_store):
    """--smollm2-shapes stands in for SmolLM2 where its GGUF cannot travel: every shape and
    rope setting equal to the real model's (only the token ids and the tied head differ)."""
    want, got = smollm2_store.config, script.ModelConfig.from_hf(script.SHAPES)
    keep = dict(bos_token_id=want.bos_token_id, eos_token_ids=want.eos_token_ids, tie_word_embeddings=want.tie_word_embeddings)
    assert dataclasses.replace(got, **keep, rms_norm_eps=want.rms_norm_eps) == want
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
