"""The pure decisions of weights from peers (shard.weight_plan): byte ranges, resume offsets,
which source fetches which file, the seeder's token bucket, and the checks on a peer's
request and chunk. Examples pin the edges; hypothesis properties pin the invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shard.layers import LayerRange
from shard.manifest import EMBED_FILE, layer_file, slice_files
from shard.weight_plan import (TokenBucket, WeightsConfig, check_chunk, check_request, choose_file, progress_line,
                               request_deadline_s, requests, resume_offset, unservable)
from shard.wire.weight_messages import WeightsChunk, WeightsRefused, WeightsRequest


def test_a_slice_is_its_layers_files_and_the_head_also_the_embedding():
    # Bug guarded: a fetcher fetching the whole model, or a head stage missing its embedding.
    assert slice_files(LayerRange(2, 4)) == (layer_file(2), layer_file(3))
    assert slice_files(LayerRange(0, 2)) == (layer_file(0), layer_file(1), EMBED_FILE)


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_resume_offset_is_the_partial_files_length_unless_it_cannot_be_a_prefix(part, size):
    offset = resume_offset(part, size)
    assert offset == (part if part <= size else 0)
    assert 0 <= offset <= size


@given(st.integers(0, 5000), st.integers(1, 5000), st.integers(1, 700))
def test_requests_cover_the_rest_of_the_file_exactly_once_in_order(offset, size, request_bytes):
    offset = min(offset, size)
    got = requests(offset, size, request_bytes)
    at = offset
    for start, length in got:  # contiguous, bounded, in order, ending at the file's end
        assert start == at and 1 <= length <= request_bytes
        at += length
    assert at == size


FILES = st.lists(st.sampled_from([f"f{i}" for i in range(8)]), unique=True, max_size=8)
PEERS = ["a", "b", "c", "d"]


@given(FILES, st.data())
def test_choose_file_never_returns_a_busy_unheld_or_excluded_choice_and_prefers_the_rarest(pending, data):
    holders = {f: tuple(data.draw(st.lists(st.sampled_from(PEERS), unique=True))) for f in pending}
    busy = set(data.draw(st.lists(st.sampled_from(pending), unique=True))) if pending else set()
    excluded = set(data.draw(st.lists(st.sampled_from(PEERS), unique=True)))
    source = data.draw(st.sampled_from(PEERS))
    f = choose_file(pending, holders, busy, excluded, source)
    candidates = [g for g in pending if g not in busy and source in holders[g]] if source not in excluded else []
    if not candidates:
        assert f is None
        return
    assert f in candidates
    live = {g: sum(1 for p in holders[g] if p not in excluded) for g in candidates}
    assert live[f] == min(live.values())


def test_a_file_only_one_source_holds_goes_first_to_that_source():
    # Bug guarded: the only holder of a rare file busy with a common one, so the fetch
    # takes the sum of both instead of the max.
    holders = {"common": ("a", "b"), "rare": ("a",)}
    assert choose_file(["common", "rare"], holders, set(), set(), "a") == "rare"
    assert choose_file(["common", "rare"], holders, {"rare"}, set(), "b") == "common"
    assert unservable(["common", "rare"], holders, {"a"}) == "rare"
    assert unservable(["common", "rare"], holders, set()) is None


def test_the_token_bucket_sends_a_burst_at_once_then_at_its_rate():
    bucket = TokenBucket(rate_bytes_per_s=1000.0, capacity_bytes=500.0)
    assert bucket.reserve(500, 0.0) == 0.0  # the burst
    assert bucket.reserve(1000, 0.0) == pytest.approx(1.0)  # queued behind it: 1000 B at 1000 B/s
    assert bucket.reserve(500, 0.5) == pytest.approx(1.0)  # FIFO: waits for what is queued before it
    assert TokenBucket(math.inf, 1).reserve(10**9, 0.0) == 0.0


@given(st.lists(st.integers(1, 4000), min_size=1, max_size=40), st.floats(100.0, 1e6), st.floats(1.0, 5000.0))
def test_the_token_bucket_never_lets_more_through_than_rate_times_time_plus_a_burst(sizes, rate, capacity):
    # Sound: each send starts at now + its delay; by then the bucket has been allowed
    # capacity + rate * start bytes, which must cover everything sent up to and including it.
    bucket, now, sent = TokenBucket(rate, capacity), 0.0, 0
    for n in sizes:
        start = now + bucket.reserve(n, now)
        sent += n
        assert sent <= capacity + rate * start + 1e-6 * sent
        now = start  # the sender sends, then asks again


def test_a_request_is_checked_against_the_manifest_before_any_file_is_touched(tiny_llama_store):
    m = tiny_llama_store.manifest
    rel = layer_file(1)
    size = m.files[rel].bytes

    def req(**kw):
        return WeightsRequest(**{"manifest_digest": m.digest, "file": rel, "offset": 0, "length": 10, **kw})

    assert check_request(m, req()) is None
    assert check_request(m, req(offset=size - 10)) is None
    assert "past the end" in check_request(m, req(offset=size - 9))
    assert "not a weight file" in check_request(m, req(file="tokenizer/tokenizer.json"))
    assert "not a weight file" in check_request(m, req(file="../manifest.json"))
    assert "is not this node's model" in check_request(m, req(manifest_digest="f" * 64))


def test_a_chunk_must_be_the_next_bytes_asked_for():
    chunk = WeightsChunk(offset=100, data=b"x" * 50)
    assert check_chunk(chunk, 100, 150) is None
    assert check_chunk(chunk, 90, 150) == "chunk at offset 100, expected 90"
    assert check_chunk(chunk, 100, 149) == "chunk of 50 bytes runs past the requested end 149"
    assert check_chunk(WeightsRefused(code="busy", reason="r"), 0, 1).startswith("sent WeightsRefused")


def test_progress_names_bytes_rate_and_eta():
    line = progress_line("layers [0, 10)", 45_000_000, 90_000_000, 10.0, 2)
    assert line == "fetching layers [0, 10): 45.0 of 90.0 MB (50%), 4.50 MB/s, ETA 10 s, 2 sources"
    assert "ETA ?" in progress_line("x", 0, 10, 0.0, 1)


def test_a_request_may_take_the_chunk_timeout_plus_its_bytes_at_the_slowest_rate_a_source_keeps():
    # Bug guarded: a source trickling a byte per chunk timeout holding a file forever.
    config = WeightsConfig(chunk_timeout_s=60.0, min_source_bytes_per_s=32e3)
    assert request_deadline_s(16 << 20, config) == pytest.approx(60.0 + (16 << 20) / 32e3)


def test_the_config_refuses_a_share_outside_0_1_and_oversized_chunks():
    with pytest.raises(ValueError, match="seed_upload_share must be in \\[0, 1\\], got 1.5"):
        WeightsConfig(seed_upload_share=1.5)
    with pytest.raises(ValueError, match="chunk_bytes"):
        WeightsConfig(chunk_bytes=2 << 20)


def test_the_join_flags_reach_the_node_config_and_a_bad_share_is_one_line(capsys):
    # Bug guarded: --fetch-weights not reaching NodeConfig (a component's flag), or a share
    # out of range ending `shard-node join` in a traceback instead of one line.
    from shard.cli import build_parser, main
    from shard.node_config import NodeConfig
    from shard.options import config_from_args

    args = build_parser().parse_args(["join", "--coordinator", "/ip4/127.0.0.1/tcp/1", "--fetch-weights",
                                      "--seed-upload-share", "0.25"])
    config = config_from_args(NodeConfig, args)
    assert config.weights.fetch_weights and config.weights.seed_upload_share == 0.25
    assert not NodeConfig(coordinator="x").weights.fetch_weights
    assert main(["join", "--coordinator", "/ip4/127.0.0.1/tcp/1", "--seed-upload-share", "2"]) == 1
    assert capsys.readouterr().err == ("shard-node join: error: bad option: seed_upload_share must be in [0, 1], "
                                       "got 2.0\n")
