"""The ring engine's settings: one frozen dataclass holds every default, and the CLI is
derived from it (coordinator.cli). This module does not know what uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_EAGLE_TREE = 256  # draft nodes in one verify frame
MAX_PIPELINE_DEPTH = 8  # rounds in flight for one job


@dataclass(frozen=True)
class EngineConfig:
    prefill_chunk_tokens: int = 256  # the largest prefill chunk (coordinator.jobs.prefill)
    prefill_edge_chunk_tokens: int = 64  # the first and last: short pipeline fill and drain
    frame_timeout_s: float = 120.0  # one traversal; past it the job resumes on a new ring
    max_resumes: int = 3
    resume_wait_s: float = 10.0  # after a stage error, how long to wait for the ring to re-form
    link_latency_ms: float = 0.0  # emulated one-way latency on the coordinator -> head edge
    link_upload_mbps: float = 0.0
    link_jitter_ms: float = 0.0
    draft: str = "hybrid"  # none | ngram | eagle | hybrid (n-gram and EAGLE, routed per round)
    eagle_head: str | None = None  # head directory; default: the one shipped for the model
    eagle_tree: tuple[int, int] | None = None  # fixed (nodes, depth); default: sized by the head's confidence
    # Most rounds in flight (later ones sent before earlier are verified); 1 = off. The
    # planner picks the depth below this cap from acceptance and the measured queue a round
    # in flight makes (coordinator/spec/adapt.py), so on a compute-bound ring it rarely sends a
    # round ahead whatever the cap (docs/benchmarks.md).
    max_pipeline_depth: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.max_pipeline_depth <= MAX_PIPELINE_DEPTH:
            raise ValueError(f"pipeline depth (rounds in flight) must be 1..{MAX_PIPELINE_DEPTH}, "
                             f"got {self.max_pipeline_depth}")
        if self.eagle_tree is not None and not (1 <= self.eagle_tree[1] <= self.eagle_tree[0] <= MAX_EAGLE_TREE):
            raise ValueError(f"eagle_tree (nodes, depth) needs 1 <= depth <= nodes <= {MAX_EAGLE_TREE}, "
                             f"got {self.eagle_tree}")

