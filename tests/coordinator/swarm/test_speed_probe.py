"""A newcomer's measured speed against its claim (coordinator.swarm.speed_probe), pure parts.

Guards: the red team's staller was seated on a claimed speed it never had; the selector
must use the measured figure once a claim is far faster than the measurement, keep an
honest claim (the probe's own overhead must not make every node look slower than it
said), and a node whose rows are wrong must not pass the comparison.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from coordinator.swarm.speed_probe import (PROBE_JOB_ID, Measured, agrees, past_slack, per_layer_s, probe_frame,
                                           probe_layer, seated_speed, transfer_s)
from shard.wire.codec import decode, encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Register


def _reg(**kw) -> Register:
    base = dict(peer_id="p", model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-4, upload_bytes_per_s=1e6, download_bytes_per_s=1e6)
    return Register(**{**base, **kw})


def test_a_timed_request_less_an_idle_one_over_its_layers_and_rows():
    assert per_layer_s(0.012, 0.002, 1) == 0.010
    assert abs(per_layer_s(0.066, 0.002, 2, 32) - 0.001) < 1e-12
    assert per_layer_s(0.001, 0.002, 1) == 0.0  # noise: an idle request that took longer is not negative compute


def test_a_replys_rows_crossing_a_slow_uplink_are_not_counted_as_compute():
    # Guards: a 64-row reply over a 2 Mbit/s uplink read as a slow stage's compute, so the
    # selector counted the node's link twice (test_topology_ring's slow-uplink node).
    assert transfer_s(16_000, 250_000, 1e6, 250e3) == 0.016 + 1.0
    assert transfer_s(16_000, 250_000, 0.0, -1.0) == 0.0  # unmeasured rates: nothing taken off


def test_a_claim_100x_faster_than_measured_is_replaced_and_an_honest_one_stands():
    assert seated_speed(1e-5, 1e-3, slack=4.0) == 1e-3  # claims 100x: the measurement
    assert seated_speed(1e-3, 3e-3, slack=4.0) == 1e-3  # within the slack: the node's own figure
    assert seated_speed(1e-3, 1e-4, slack=4.0) == 1e-3  # measured faster: never seated faster than it says


@given(st.floats(1e-7, 1.0), st.floats(0.0, 10.0), st.floats(1.0, 100.0))
def test_the_seated_figure_is_never_faster_than_the_claim_nor_than_measured_over_slack(claimed, measured, slack):
    got = seated_speed(claimed, measured, slack)
    assert got >= claimed and got >= measured / slack and got in (claimed, measured)


def test_rows_agree_within_the_tolerance_of_their_rms_and_not_beyond():
    ours = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    rms = ours.pow(2).mean(dim=1, keepdim=True).sqrt()
    assert agrees(ours + 0.5e-2 * rms, ours, 1e-2)
    assert not agrees(ours + 2e-2 * rms, ours, 1e-2)
    assert not agrees(torch.randn(8, 16), ours, 1e-2)  # a liar's random rows
    assert not agrees(ours[:4], ours, 1e-2)  # fewer rows than asked
    assert not agrees(torch.full_like(ours, float("nan")), ours, 1e-2)


def test_the_probed_layer_is_one_it_holds_past_the_embedding_else_one_it_stores_else_one_to_fetch():
    # Guards: a probe of a layer the node does not keep made it fetch weights (a side effect
    # formation's weight-move tests caught), so a node keeping one is probed on it; a node
    # keeping none fetches one (it was seated on its claim unprobed: issue 20).
    assert probe_layer(_reg(held_start=3, held_end=6), 8) == 3
    assert probe_layer(_reg(held_start=0, held_end=4), 8) == 1  # layer 0 takes tokens, not rows
    assert probe_layer(_reg(held_start=0, held_end=1, stored_files=("layers/00000.safetensors",)), 8, [3]) == 3
    assert probe_layer(_reg(stored_files=("manifest.json", "layers/00000.safetensors", "layers/00005.safetensors")), 8) == 5
    assert probe_layer(_reg(), 8) == 1


def test_a_probe_frame_is_a_canonical_forward_the_node_decodes(tiny_llama_store):
    # Sound: a node decodes a verify request's frames with its own limits, canonical only;
    # a probe frame that failed there would fail every probe and seat nobody.
    cfg = tiny_llama_store.config
    frame = probe_frame(cfg.hidden_size, 64, bytes(range(16)))
    got = decode(encode_body(frame), Limits.for_model(cfg, max_tokens_per_frame=2048), canonical=True)
    assert got.job_id == PROBE_JOB_ID and got.hidden.shape == (64, cfg.hidden_size)
    assert got.positions.tolist() == list(range(64)) and torch.equal(got.hidden, frame.hidden)


def test_a_reading_past_the_slack_on_either_figure_is_taken_again():
    # Bug guarded: one noisy probe on a loaded machine (an honest node read 34x its claim)
    # seated as the node's speed, leaving it 1 layer of 30. Sound: past_slack is exactly
    # "seated_speed would replace the claim", for decode or prefill.
    reg = Register(peer_id="a", model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                   decode_s_per_layer=0.69e-3, prefill_s_per_layer_token=85e-6, upload_bytes_per_s=1e6,
                   download_bytes_per_s=1e6, rtt_ms={}, listen_addrs=())
    assert past_slack(reg, Measured(1, 23.29e-3, 0.45e-3, True), slack=10.0)  # the reading seen: decode 34x
    assert past_slack(reg, Measured(1, 0.7e-3, 0.9e-3, True), slack=10.0)  # prefill 10.6x
    assert not past_slack(reg, Measured(1, 6.0e-3, 0.45e-3, True), slack=10.0)  # within 10x: the claim stands
    assert not past_slack(reg, Measured(1, 0.0, 0.0, True), slack=10.0)
