"""Audits of stages that run quantised weights (shard.quant).

Guards two ways the auditor could be wrong about such a stage: accusing an honest one
(its replay must use the same quantised weights, and compare frame by frame, since a
quantised stage's bf16 activation rounding turns the tree replay's last-bit differences
into bf16 steps), and passing a dishonest one (a stage that registers int8 and runs int4,
or registers none and runs int8, cuts memory and time behind the auditor's back; its
outputs must fall outside the tolerance of the scheme it declared). The logged frames are
what a real StageWorker sent, with receipt digests over them, through check_frames.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from coordinator.trust.audit import AuditPlan
from coordinator.trust.compare import check_frames
from coordinator.trust.tolerance import TOLERANCES, stage_tolerance
from receipts import sha256_digest
from ring import PeerId
from shard.layers import LayerRange
from shard.quant import SCHEMES, quantise_stage
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.codec import encode_body
from shard.wire.limits import Limits
from tests.coordinator.trust.test_audit_replay import engine_like_frames


def test_a_quantised_stage_is_held_to_the_kernels_bf16_step_or_the_wires_if_coarser():
    assert stage_tolerance("f32") == TOLERANCES["f32"]
    assert stage_tolerance("f32", "int4") == TOLERANCES["bf16"] == stage_tolerance("f16", "int8")
    assert stage_tolerance("bf16", "int4-g64") == TOLERANCES["bf16"]
    assert stage_tolerance("f8_e4m3fn", "int4") == TOLERANCES["f8_e4m3fn"]


@pytest.fixture(scope="module")
def middle(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(1, store.config.num_layers)
    stages = {name: quantise_stage(Stage(store.config, r, store.load_layers(r)), SCHEMES[name]) for name in SCHEMES
              if name in ("none", "int8", "int4")}
    return store, r, stages


def logged(stage: Stage, r: LayerRange, declared: str) -> tuple[AuditPlan, dict]:
    """What the stage logged and signed for one job's frames, and the plan auditing it."""
    frames = engine_like_frames(False, stage.cfg.hidden_size)
    worker = StageWorker(stage, WorkerConfig(wire_dtype="f32"))
    records, receipts = {}, {}
    for f in frames:
        inp, out = encode_body(f), encode_body(worker.process(f))
        records[f.round] = (inp, out)
        receipts[f.round] = SimpleNamespace(input_digest=sha256_digest(inp), output_digest=sha256_digest(out))
    plan = AuditPlan("j", 1, PeerId("stage"), r, False, "f32", None, tuple(records), receipts, quant=declared)
    return plan, records


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_an_honest_quantised_stage_is_not_accused(middle, scheme):
    store, r, stages = middle
    plan, records = logged(stages[scheme], r, scheme)
    assert check_frames(stages[scheme], plan, records, Limits.for_model(store.config)) is None


@pytest.mark.parametrize("declared, ran", [("int8", "int4"), ("none", "int8"), ("int4", "int8")])
def test_a_stage_running_another_scheme_than_it_declared_is_caught(middle, declared, ran):
    store, r, stages = middle
    plan, records = logged(stages[ran], r, declared)
    finding = check_frames(stages[declared], plan, records, Limits.for_model(store.config))
    assert finding is not None and finding.check == "output_mismatch"


def test_a_quantised_stage_is_replayed_frame_by_frame(middle):
    """Why: on SmolLM2 (layers 1-29, the engine-like frames above) an honest int8 stage's
    tree replay needed up to 26x the bf16 tolerance on one frame (bf16 rounding amplifies
    re-summation differences layer by layer), while frame by frame it is exact. On the tiny
    model both stay inside, so this checks the switch: declaring int4 replays one forward
    per frame, declaring none merges frames."""
    from shard.replay import ReplayStats

    store, r, stages = middle
    plan, records = logged(stages["int4"], r, "int4")
    stats = ReplayStats()
    assert check_frames(stages["int4"], plan, records, Limits.for_model(store.config), stats=stats) is None
    assert stats.forwards == len(records)
    stats = ReplayStats()
    check_frames(stages["int4"], dataclasses.replace(plan, quant="none"), records, Limits.for_model(store.config),
                 stats=stats)
    assert stats.forwards < len(records)
