"""The auditor's settings (AuditConfig) and counts (AuditStats): how often, how much at once,
how long an audit may wait; what the audits did. Data only (coordinator.trust.audit runs them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shard.options import option
from shard.replay import ReplayStats


@dataclass(frozen=True)
class AuditConfig:
    # Probability that a (job, epoch, stage) is audited: its every verified frame of the
    # job recomputed and compared. A stage that cheats on at least one verified frame per
    # request escapes n requests with probability (1 - rate)^n: 0.75^20 = 0.3% at 0.25.
    # Cost: rate x (one batched replay of the job's rows / the ring's per-frame compute
    # of the job); docs/receipts.md gives the measured ratio (scripts/bench_receipts_ring.py).
    rate: float = option(0.25, "probability a (job, stage) is audited by replay; cost in docs/receipts.md",
                         flag="--audit-rate")
    reply_timeout_s: float = 30.0
    # Frame bytes one AuditReply carries (one frame always, however large): a 160-round
    # decode job's frames at f32 are ~0.8 MB, so most audits take one round trip; a reply
    # holds the stage's control stream ~0.2 s on a 50 Mbit/s uplink.
    fetch_reply_bytes: int = 1 << 20
    max_queued_jobs: int = 256  # finished jobs waiting to be drawn, and drawn ones for a slot; more are not audited
    # Jobs audited at once: an audit mostly waits (on the stage's records, on a verifier's
    # recomputation), and one at a time fell behind at 16 streams (1 audit in a 40 s window,
    # the rest skipped as stale). The gateway's own CPU work stays one at a time (its limiter).
    max_concurrent_audits: int = 4
    # A job that ends while other jobs' audits are in flight or waiting starts its own at a
    # random time within this many seconds, its audit slot free meanwhile: clients' requests
    # end in clusters (a closed loop's every ~10 s at 16 streams), and their audits, begun
    # together, took the ring's CPU in bursts (fetches, verify requests, replays on the
    # stages' cores) in the seconds when the cluster's next requests were starting: the
    # 16-stream ITL tail and TTFT (issue 21; docs/batching.md). A job alone starts at once.
    # Each stage's audit is skipped as stale if it would begin past max_job_age_s; past
    # max_queued_jobs jobs in flight (a backlog), jobs start as slots free, unspread.
    spread_s: float = 10.0
    max_cached_slices: int = 4  # slices kept loaded for replays
    # Forked jobs' sources' frames fetched from a stage, kept for the next fork's audit there
    # (coordinator.trust.source_frames): a 200-token prompt's are ~1 MB a stage at f32.
    source_frames_mb: int = 32
    # Slices loaded for replays are dropped after this long with no audit to run: a
    # 10-layer SmolLM2 slice is 140 MB in f32, which a gateway kept for good after one
    # audit it recomputed itself (bench_hostile_ring read it as the attack's growth).
    slice_idle_s: float = 60.0
    max_replay_rows: int = 1024  # rows per replay forward (its attention mask is rows x rows)
    # A job that waited longer than this for its audit is not audited: nodes drop a job's
    # frame log FrameLogConfig.grace_s (300 s) after it ends, and a dropped log reads as
    # a missing record, which would accuse an honest stage. Keep it below that grace.
    max_job_age_s: float = 240.0
    # Verifiers asked at most per audit: a first, a second opinion when it disagrees with
    # the stage, a third when those two disagree (coordinator.trust.opinions).
    max_opinions: int = 3
    verify_timeout_s: float = 60.0  # a verifier's recomputation: about one prefill of the job's rows
    # The largest control frame a verify request or its reply is cut to (shard.verify_parts);
    # None: the swarm's control frame cap. Smaller (>= 2 KiB) only to cut short jobs in tests.
    verify_part_bytes: int | None = None
    # When no verifier node can recompute a slice, recompute it here, if this gateway's
    # store holds the slice's layer files; False: such audits wait for a verifier (skipped).
    replay_here: bool = True


@dataclass
class AuditStats:
    audits: int = 0
    frames_compared: int = 0
    replay_s: float = 0.0  # wall time of check_frames (digests, decode, replay, compare)
    replay: ReplayStats = dataclasses.field(default_factory=ReplayStats)  # forwards and rows replayed
    skipped_stale: int = 0  # jobs not audited: older than max_job_age_s when their turn came
    skipped_gone: int = 0  # (job, stage) audits not done: the stage left the swarm first
    skipped_no_verifier: int = 0  # audits not done: no verifier answered and the slice is not held here
    # (job, stage) audits not done: the job forked from a source whose receipts are not known
    # here, that ended longer than max_job_age_s ago, or whose frames on the stage cannot
    # make the K/V the fork started from
    skipped_no_prefix: int = 0
    by_verifiers: int = 0  # recomputations done by verifier-role nodes
    by_members: int = 0  # recomputations done by other members keeping the slice (stages, standbys)
    by_coordinator: int = 0  # recomputations done here (no verifier could)
    second_opinions: int = 0  # audits that asked more than one verifier
    unsettled: int = 0  # audits whose opinions tied (the stage judged, no verifier accused)
    lying_verifiers: int = 0  # verifiers outvoted and excluded
    disputed: int = 0  # audits left to the dispute book: a newcomer verifier's word alone against the stage
