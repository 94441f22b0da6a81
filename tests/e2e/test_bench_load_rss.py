"""bench_load's RSS growth over a sustained run (scripts/bench_load.py, rss_growth).

Bug guarded: growth read off two single samples only, so a stage whose running jobs' K/V
swings hundreds of MB read +9% or -9% by the cycle's phase; the troughs' figure must show a
flat baseline as flat and a rising one as rising, and skip a process that was gone.
"""

from __future__ import annotations

from scripts.bench_load import rss_growth


def _samples(node_mb):
    return [{"t_s": 10.0 * i, "coordinator_mb": 600.0, "nodes_mb": [mb]} for i, mb in enumerate(node_mb)]


def test_troughs_of_a_swinging_but_flat_stage_read_flat():
    swing = [1000, 1300, 1000, 1300, 1000, 1300, 1000, 1300, 1000, 1300]  # a sample per 10 s
    g = rss_growth(_samples(swing), warmup_s=10.0)
    assert g["nodes_pct"] == [0.0] and g["troughs_nodes_pct"] == [0.0]  # 1300 -> 1300 by the two samples
    g = rss_growth(_samples(swing + [1000]), warmup_s=10.0)
    assert g["nodes_pct"] == [-23.1] and g["troughs_nodes_pct"] == [0.0]


def test_troughs_of_a_rising_stage_read_rising_and_a_gone_process_is_skipped():
    rising = [1000 + 20 * i + (300 if i % 2 else 0) for i in range(12)]
    g = rss_growth(_samples(rising), warmup_s=0.0)
    assert g["troughs_nodes_pct"] == [round(100 * (1160 - 1000) / 1000, 1)]
    gone = _samples([1000, None, 1100, None, 1000, 1200])
    assert rss_growth(gone, warmup_s=0.0)["troughs_nodes_pct"] == [0.0]


def test_trough_shift_by_mapping_names_the_kind_that_rose():
    # Sound: what a stage's rising trough is made of (glibc's arenas against K/V's mappings)
    # is read per kind from each sample's split; a sample without the split is skipped.
    def sample(i, arenas, anon):
        split = {"thread_arenas": arenas, "anon": anon, "file": 300.0}
        return {"t_s": 10.0 * i, "coordinator_mb": 600.0, "nodes_mb": [arenas + anon + 300],
                "by_mapping_mb": [{"thread_arenas": 50.0, "anon": 10.0, "file": 500.0}, split]}
    samples = [sample(i, 100 + 5 * i, 400 + (200 if i % 2 else 0)) for i in range(12)]
    samples[7] = {"t_s": 70.0, "coordinator_mb": 600.0, "nodes_mb": [800.0]}
    g = rss_growth(samples, warmup_s=0.0)
    assert g["troughs_by_mapping_mb"] == [{"anon": 0.0, "file": 0.0, "thread_arenas": 0.0},
                                          {"anon": 0.0, "file": 0.0, "thread_arenas": 40.0}]
