"""The coordinator's part of weights from peers, pure (coordinator.swarm.seeding): who is
handed out as a source for which file, what a fetch is predicted to take, and the log
/v1/ring shows. Guards: the asker listed as its own source, the coordinator's uplink used
while a node holds the file, a node's loaded slice missing from what it can seed, and
a prediction that ignores the seeding share or the receiver's download."""

from __future__ import annotations

import pytest

from coordinator.swarm.seeding import FetchLog, FetchRecord, files_held, held_or_stored, holders, predicted_fetch_s
from ring import ChurnPolicy, PeerId
from shard.layers import LayerRange
from shard.manifest import EMBED_FILE, layer_file
from shard.wire.messages import Register

A, B, C, ME, COORD = (PeerId(p) for p in ("A", "B", "C", "ME", "COORD"))
L0, L1, L2 = layer_file(0), layer_file(1), layer_file(2)


def _register(stored=()) -> Register:
    return Register(peer_id="x", model="m", manifest_digest="d", device="cpu", memory_bytes=1, decode_s_per_layer=0.0,
                    prefill_s_per_layer_token=0.0, upload_bytes_per_s=1.0, download_bytes_per_s=1.0,
                    stored_files=tuple(stored))


def test_a_node_holds_what_it_stored_and_the_slice_it_loaded():
    assert files_held(_register([L2]), LayerRange(0, 2)) == {L0, L1, EMBED_FILE, L2}
    assert files_held(_register(), None) == frozenset()


def test_holders_are_nodes_best_upload_first_never_the_asker_and_the_coordinator_only_as_a_last_resort():
    held = {A: frozenset({L0, L1}), B: frozenset({L0}), ME: frozenset({L0, L1, L2}), C: frozenset()}
    uploads = {A: 1e6, B: 5e6, ME: 1e9}
    got = holders([L0, L1, L2], held, uploads, ME, COORD, frozenset({L0, L1, L2}))
    assert got == {L0: (B, A), L1: (A,), L2: (COORD,)}
    assert holders([L2], held, uploads, ME, COORD, frozenset())[L2] == ()  # nobody: the fetch must fail, not hang


def test_the_prediction_takes_the_share_of_the_sources_uploads_capped_by_the_download():
    policy = ChurnPolicy()
    share = policy.seed_upload_share
    one = predicted_fetch_s(10_000_000, {L0: (A,), L1: (A,)}, 1e9, {A: 2e6}, COORD, policy)
    assert one == pytest.approx(10_000_000 / (share * 2e6))
    two = predicted_fetch_s(10_000_000, {L0: (A, B), L1: (A, B)}, 1e9, {A: 2e6, B: 2e6}, COORD, policy)
    assert two == pytest.approx(one / 2)  # two files from two sources in parallel
    capped = predicted_fetch_s(10_000_000, {L0: (A, B), L1: (A, B)}, 1e6, {A: 2e6, B: 2e6}, COORD, policy)
    assert capped == pytest.approx(10.0)  # the receiver's 1 MB/s download
    origin = predicted_fetch_s(10_000_000, {L0: (COORD,)}, 1e9, {}, COORD, policy)
    assert origin == pytest.approx(10_000_000 / policy.origin_upload_bytes_per_s)
    assert predicted_fetch_s(1, {L0: ()}, 1e9, {}, COORD, policy) is None


def test_files_are_whole_units_of_work_so_8_files_from_3_sources_take_3_files_time():
    # Bug guarded: predicting bytes / (3 sources' rate) when each file comes from one source
    # (shard.weight_fetch): the third round has only 2 files, so the fetch takes 3 files' time.
    # Sound: 8 files of 1 MB at 1 MB/s each (share of 2 MB/s) from 3 sources end after 3 s.
    files = {layer_file(i): (A, B, C) for i in range(8)}
    share = ChurnPolicy().seed_upload_share
    got = predicted_fetch_s(8_000_000, files, 1e12, {A: 1e6 / share, B: 1e6 / share, C: 1e6 / share}, COORD,
                            ChurnPolicy())
    assert got == pytest.approx(3.0)
    # A source twice as fast takes twice the files: 4 + 2 + 2 files, 2 s.
    got = predicted_fetch_s(8_000_000, files, 1e12, {A: 2e6 / share, B: 1e6 / share, C: 1e6 / share}, COORD,
                            ChurnPolicy())
    assert got == pytest.approx(2.0)


def test_the_fetch_log_keeps_a_bounded_window_with_measured_and_predicted():
    log = FetchLog(window=2)
    for i in range(3):
        log.add(FetchRecord(PeerId(f"p{i}"), LayerRange(0, 2), 3, 1000, 2.0, 1.5, None, {"A": 1000}, {}, 0.0))
    rows = log.summary()
    assert [r["peer"] for r in rows] == ["p1", "p2"]
    assert rows[0]["measured_bytes_per_s"] == 500.0 and rows[0]["predicted_s"] == 1.5 and rows[0]["layers"] == [0, 2]


def test_the_move_plan_sees_a_loaded_slice_else_the_longest_run_of_stored_layers():
    # Bug guarded: the selector charging a network fetch to a node that holds the layers on
    # disk (or none to one that joined empty). Sound: loaded wins; else the longest run of
    # consecutive stored layer files, the lower one on a tie; nothing stored, nothing held.
    regs = {A: _register([layer_file(i) for i in (0, 1, 3, 4, 5)]), B: _register([L0, L1]), C: _register([EMBED_FILE]),
            ME: _register([layer_file(i) for i in (1, 3)])}
    got = held_or_stored(regs, {B: LayerRange(2, 4)}, num_layers=6)
    assert got == {A: LayerRange(3, 6), B: LayerRange(2, 4), ME: LayerRange(1, 2)}
