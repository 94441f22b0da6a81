"""Which of the swarm's rings each job runs on (issue 21), and each ring as the engine sees it.

A new job goes to the ring coordinator.jobs.ring_choice predicts finishes it first, from
what is measured of each ring now: its decode round time (the median of its measured
decode rounds, else its plan's prediction), its prefill time per prompt token, the jobs
pinned to it, the tokens they still owe and the prompt tokens they have yet to prefill. A job stays on its ring while that ring's
epoch holds; when its ring breaks (gone from the swarm's rings while it re-forms, or
dropped) the job is routed again to whichever ring is formed then and resumes there
(re-prefilling its committed tokens, exactly as on a re-form). A ring whose stages' K/V
cannot hold one more job (coordinator.jobs.kv_room: what the nodes registered, what their
refusals taught) takes none: a new job goes to a ring with room, or waits for one
(`wait_room`), as does a job a stage refused for K/V anyway. Knows no frames and no
streams: the engine asks it, the swarm says which rings exist.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import trio

from coordinator.jobs.kv_room import Room, StageRoom, job_slots
from shard.kv_budget import stage_kv_bytes, stage_weight_bytes
from coordinator.jobs.ring_choice import RingLoad, choose_ring
from coordinator.swarm.swarm import RingState, Swarm

CLOSED_KEPT = 256
RECENT = 32  # a ring's timings are the median of its last this many measured rounds of a kind
ROOM_POLL_S = 1.0  # a job waiting for K/V room looks again at least this often (rings re-form, too)
LEARNED_S = 60.0  # what a K/V refusal taught holds this long (it may have been a job just ending)


@dataclass
class Pinned:
    ring_id: int
    prompt_tokens: int
    max_tokens: int
    job: Any = None  # the RingJob once opened: how many tokens it still owes
    closed: bool = False  # finished: counts for nothing; kept a while so its EndJob finds its ring
    waiting: bool = False  # waiting for K/V room: holds none the router counts


class RingRouter:
    def __init__(self, swarm: Swarm, default_max_tokens: int = 256,
                 probation: Callable[[RingState], tuple] = lambda ring: (), *, kv_step: int = 256,
                 kv_slack: int = 0) -> None:
        """`probation(ring)`: the ring's stages whose rounds the coordinator recomputes (the
        engine's shadow holds one ring's chain at a time, so at most one ring with stages
        on probation takes new jobs; the others wait until it has none). `kv_step`: the most
        slots one frame writes (a prefill chunk); `kv_slack`: slots a job's cache keeps past
        its context for draft nodes (shard.stage_worker.DRAFT_SLACK_SLOTS)."""
        self.swarm, self.probation, self.kv_step, self.kv_slack = swarm, probation, kv_step, kv_slack
        self.learned_jobs: dict[int, tuple[int, float]] = {}  # ring epoch -> (jobs it held when a stage refused K/V, until)
        self.kv_refusals = 0  # rounds a stage refused for K/V (they wait for room, then resume)
        self._room_freed = trio.Event()
        self._room_queue: deque[Pinned] = deque()  # jobs waiting for K/V room, first come first served
        self.default_max_tokens = default_max_tokens  # a request without max_tokens is costed as this many
        self.pinned: dict[str, Pinned] = {}
        self._closed: deque[str] = deque()  # closed jobs still pinned, oldest first (at most CLOSED_KEPT)
        self.moves = 0  # jobs routed again because their ring broke
        swarm.busy = self.running_on  # a join's re-form of a ring waits for its jobs (coordinator.swarm.forming.drain)
        # Prefix sources (coordinator.jobs.prefix_sources): the slots each holds on a ring's stages,
        # and letting a ring's go when a job needs their room (whether any was there).
        self.kept_slots: Callable[[int], list[int]] = lambda ring_id: []
        self.free_kept: Callable[[int], bool] = lambda ring_id: False

    def route(self, job_id: str, prompt_tokens: int, max_tokens: int | None) -> RingState | None:
        """Pin a new job to the ring predicting its earliest completion; None if none is formed."""
        self.pinned[job_id] = Pinned(-1, prompt_tokens, max_tokens or self.default_max_tokens)
        return self.ring_for(job_id)

    def attach(self, job_id: str, job: Any) -> None:
        if job_id in self.pinned:
            self.pinned[job_id].job = job

    def forget(self, job_id: str) -> None:
        """The job closed: it owes nothing; its pin stays a while, for its EndJob."""
        pin = self.pinned.get(job_id)
        if pin is None or pin.closed:
            return
        pin.closed, pin.job = True, None
        self._room_freed.set()
        self._room_freed = trio.Event()
        self._closed.append(job_id)
        while len(self._closed) > CLOSED_KEPT:
            self.pinned.pop(self._closed.popleft(), None)

    def ring_for(self, job_id: str) -> RingState | None:
        """The ring `job_id` runs on: its own while formed, else routed again (None: no ring)."""
        rings = self.swarm.rings
        pin = self.pinned.get(job_id)
        if pin is None:
            return self.swarm.ring
        if pin.ring_id in rings or pin.closed:
            return rings.get(pin.ring_id)
        if not rings:
            return None
        open_ = [rid for rid in sorted(rings) if self.routable(rid)]
        loads = [self.load(rid) for rid in ([r for r in open_ if self.fits(r, pin)] or open_)]  # one with room first
        chosen = choose_ring(loads, pin.prompt_tokens + self.produced(pin), max(1, self.owed(pin)))
        if pin.ring_id >= 0:
            self.moves += 1
        pin.ring_id = int(chosen) if chosen is not None else min(rings)
        return rings[pin.ring_id]

    def draining(self, ring_id: int) -> str | None:
        """Why ring `ring_id` drains (coordinator.swarm.ring_drain), None if it does not."""
        d, ring = self.swarm.draining.get(ring_id), self.swarm.rings.get(ring_id)
        return d.reason if d is not None and ring is not None and ring.epoch == d.epoch else None

    def routable(self, ring_id: int) -> bool:
        """Whether new jobs may go to ring `ring_id`: not while it drains and another ring
        does not; else yes unless it has stages on probation and another such ring (the one
        with jobs, else the lowest id) has the shadow."""
        rings = self.swarm.rings
        if self.draining(ring_id) and any(not self.draining(rid) for rid in rings):
            return False
        probing = [rid for rid in sorted(rings) if self.probation(rings[rid])]
        if ring_id not in probing:
            return True
        busy = [rid for rid in probing if self.jobs_on(rid)]
        return ring_id == (busy or probing)[0]

    # -- K/V room (coordinator.jobs.kv_room) ---------------------------------------------
    def slots(self, pin: Pinned) -> int:
        """Slots `pin`'s job's cache will hold on each stage at its longest."""
        max_ctx = self.swarm.store.config.max_context_tokens
        tokens = min(pin.prompt_tokens + pin.max_tokens, max_ctx) + self.kv_slack
        return job_slots(tokens, max_ctx + self.kv_slack, self.kv_step)

    def room(self, ring_id: int, without: Pinned | None = None) -> Room:
        """Ring `ring_id`'s stages' K/V bounds and the slots its open jobs (but `without`) hold."""
        ring, swarm = self.swarm.rings.get(ring_id), self.swarm
        stages = []
        caps = {a.peer_id: a.max_open_jobs for a in ring.assignments} if ring is not None else {}
        for peer, r in ring.stages if ring is not None else ():
            member = swarm.members.get(peer)
            if member is None:
                continue
            reg = member.register
            weights = stage_weight_bytes(swarm.store, r, reg.bytes_per_layer)
            stages.append(StageRoom(stage_kv_bytes(reg.memory_bytes, weights),
                                    len(r) * swarm.model.kv_bytes_per_token_layer, caps.get(peer, 0)))
        reserved = [self.slots(p) for p in self.pinned.values()
                    if p.ring_id == ring_id and not p.closed and not p.waiting and p is not without]
        reserved += self.kept_slots(ring_id)
        learned, until = self.learned_jobs.get(ring.epoch, (0, 0.0)) if ring is not None else (0, 0.0)
        return Room(stages, reserved, learned if time.monotonic() < until else 0)

    def fits(self, ring_id: int, pin: Pinned) -> bool:
        return self.room(ring_id, pin).fits(self.slots(pin))

    async def wait_room(self, job_id: str, timeout_s: float) -> bool:
        """Until `job_id` fits its ring's K/V, or another ring's (it moves there; it holds no
        K/V anywhere while it waits), first come first served. True at once if no ring could
        hold it even alone (its stages decide); False if `timeout_s` passed first."""
        pin = self.pinned[job_id]
        pin.waiting = True
        self._room_queue.append(pin)
        try:
            return await self._wait_room(pin, timeout_s)
        finally:
            pin.waiting = False
            self._room_queue.remove(pin)
            self._room_freed.set()  # the next in line may go
            self._room_freed = trio.Event()

    async def _wait_room(self, pin: Pinned, timeout_s: float) -> bool:
        with trio.move_on_after(timeout_s):
            while True:
                rings = self.swarm.rings
                first = self._room_queue[0] is pin  # a job waiting longer goes first
                if first and pin.ring_id in rings and not self.draining(pin.ring_id):
                    if self.fits(pin.ring_id, pin):
                        return True
                    if self.free_kept(pin.ring_id):  # kept prefixes give way to a job
                        continue
                need = self.slots(pin)
                if rings and not any(self.room(rid).could_ever_fit(need) for rid in rings):
                    return True
                other = [rid for rid in sorted(rings) if rid != pin.ring_id and self.routable(rid) and self.fits(rid, pin)]
                if first and other:
                    chosen = choose_ring([self.load(rid) for rid in other], pin.prompt_tokens + self.produced(pin),
                                         max(1, self.owed(pin)))
                    self.moves += pin.ring_id >= 0 and self.produced(pin) > 0
                    pin.ring_id = int(chosen) if chosen is not None else other[0]
                    return True
                with trio.move_on_after(ROOM_POLL_S):
                    await self._room_freed.wait()
        return False

    def refused(self, job_id: str) -> None:
        """A stage of `job_id`'s ring refused it for K/V: that ring holds no more jobs than
        the others open on it now (at least one), for LEARNED_S or until it re-forms."""
        pin = self.pinned.get(job_id)
        ring = self.swarm.rings.get(pin.ring_id) if pin is not None else None
        self.kv_refusals += 1
        if ring is not None:
            others = len(self.room(ring.ring_id, pin).reserved)
            for gone in [e for e in self.learned_jobs if self.swarm.ring_by_epoch(e) is None]:
                del self.learned_jobs[gone]
            self.learned_jobs[ring.epoch] = (max(1, others), time.monotonic() + LEARNED_S)

    def drop(self, job_id: str) -> None:
        """A job that never opened (it waited for room and left): as if never routed."""
        self.pinned.pop(job_id, None)
        self._room_freed.set()
        self._room_freed = trio.Event()

    def retry_after_s(self) -> int:
        """Seconds until a job somewhere is predicted to finish (Retry-After of a 429)."""
        soonest = [self.timings(self.swarm.rings[p.ring_id])[0] * self.owed(p) for p in self.pinned.values()
                   if not p.closed and p.ring_id in self.swarm.rings]
        return max(1, min(600, math.ceil(min(soonest, default=10.0))))

    async def wait_ring(self, job_id: str) -> RingState:
        """`job_id`'s ring once one is formed."""
        while (ring := self.ring_for(job_id)) is None:
            await self.swarm.wait_ring()
        return ring

    def ring_with_tail(self, peer: str) -> RingState | None:
        """The formed ring whose tail is `peer` (its results are ours to take)."""
        return next((r for r in self.swarm.rings.values() if r.tail == peer), None)

    def running_on(self, epoch: int) -> int:
        """Jobs open on the ring of `epoch` (0 once it is gone)."""
        ring = self.swarm.ring_by_epoch(epoch)
        return self.jobs_on(ring.ring_id) if ring is not None else 0

    def jobs_on(self, ring_id: int, waiting: bool = False) -> int:
        """Jobs open on ring `ring_id` (`waiting`: those pinned to it waiting for K/V room instead)."""
        return sum(1 for p in self.pinned.values() if p.ring_id == ring_id and not p.closed and p.waiting == waiting)

    @staticmethod
    def produced(pin: Pinned) -> int:
        job = pin.job
        return max(0, len(job.committed) - len(job.prompt_ids)) if job is not None else 0

    def owed(self, pin: Pinned) -> int:
        return max(0, pin.max_tokens - self.produced(pin))

    @staticmethod
    def prefill_owed(pin: Pinned) -> int:
        """Prompt (or, resuming, committed) tokens whose K/V `pin`'s ring does not hold yet:
        the whole prompt until its job opens; then what its committed tokens are ahead of the
        ring's context, less the root (a decode round's one token), until a round commits."""
        job = pin.job
        if job is None:
            return pin.prompt_tokens
        return max(0, len(job.committed) - 1 - job.ring_ctx) if job.committed else pin.prompt_tokens

    def load(self, ring_id: int) -> RingLoad:
        """Ring `ring_id` as measured now. Its rounds are shared by the jobs on it, so the
        tokens they owe are work ahead of a new job (max_batch 1 in ring_choice's terms)."""
        ring = self.swarm.rings.get(ring_id)
        round_s, prefill_s = self.timings(ring)
        on = [p for p in self.pinned.values() if p.ring_id == ring_id and not p.closed]
        return RingLoad(str(ring_id), ring is not None, round_s, prefill_s, running=len(on), max_batch=1,
                        owed_tokens=sum(self.owed(p) for p in on),
                        owed_prefill_tokens=sum(self.prefill_owed(p) for p in on))

    def timings(self, ring: RingState | None) -> tuple[float, float]:
        """(decode round s, prefill s per prompt token) of `ring`: the median of its recent
        measured rounds; for a ring not measured yet, the median of the measured rings'
        (a new ring is most like its siblings); with no ring measured, the median of the
        formed rings' plan predictions, the same for all. The cost model's estimates are
        not compared across rings: they differ most where it guessed links (a ring chosen
        from the nodes left over is the one whose links went unmeasured), several-fold in
        bench_rings, which sent a first burst 14 / 2; a ring's first round measures it."""
        if ring is None:
            return 0.0, 0.0
        return self._measured(0, ring), self._measured(1, ring)

    def _predicted(self, kind: int) -> float:
        prompt = max(self.swarm.config.topology.prompt_tokens, 1)
        plans = [self.swarm.ring_plans[rid][0] for rid in self.swarm.rings if rid in self.swarm.ring_plans]
        values = [p.decode_step_s if kind == 0 else p.ttft_s / prompt for p in plans]
        return statistics.median(values) if values else 0.0

    def _measured(self, kind: int, ring: RingState) -> float:
        by_epoch: dict[int, list[float]] = {}
        for t, _ in self.swarm.traversals.samples:
            if t.prefill == (kind == 1):
                by_epoch.setdefault(t.epoch, []).append(t.traversal_s if kind == 0 else t.traversal_s / max(t.tokens, 1))
        own = by_epoch.get(ring.epoch)
        if own:
            return statistics.median(own[-RECENT:])
        others = [statistics.median(v[-RECENT:]) for e, v in by_epoch.items() if self.swarm.ring_by_epoch(e) is not None]
        return statistics.median(others) if others else self._predicted(kind)

    def status(self, model_id: str, active_jobs: int) -> dict[str, Any]:
        """The engine's /v1/ring: the first ring's members and epoch (the fields a single
        ring always had), the swarm's topology, and `rings`: every ring formed."""
        swarm, ring, members = self.swarm, self.swarm.ring, []
        for a in ring.assignments if ring is not None else ():
            reg = swarm.members.get(a.peer_id)
            members.append({"peer_id": a.peer_id, "layers": [a.layer_start, a.layer_end], "role": a.role,
                            "decode_ms_per_layer": reg.register.decode_s_per_layer * 1e3 if reg else None,
                            "device": reg.register.device if reg else None})
        return {"ready": ring is not None, "model": model_id, "epoch": ring.epoch if ring else None,
                "members": members, "registered_nodes": len(swarm.members), "active_jobs": active_jobs,
                "wire_dtype": swarm.config.wire_dtype, "topology": swarm.topology_info(),
                "rings": self.info(), "jobs_moved": self.moves, "kv_refusals": self.kv_refusals}

    def info(self) -> list[dict[str, Any]]:
        """Every ring formed, for /v1/ring: its id, epoch, stages, jobs, timings, its
        newcomers nothing trusted can check and why it drains (None: it does not)."""
        out = []
        for rid, ring in sorted(self.swarm.rings.items()):
            round_s, prefill_s = self.timings(ring)
            out.append({"ring_id": rid, "epoch": ring.epoch, "jobs": self.jobs_on(rid),
                        "stages": [{"peer_id": p, "layers": [r.start, r.end]} for p, r in ring.stages],
                        "round_s": round_s, "prefill_s_per_token": prefill_s, "waiting_for_kv": self.jobs_on(rid, True),
                        "draining": self.draining(rid),  # why it takes no new jobs (coordinator.swarm.ring_drain)
                        # stages on probation nothing trusted can check now (coordinator.swarm.ring_set.prefer_verifiable)
                        "seated_unverified": list(self.swarm.unverifiable(ring.stages)) if self.swarm.unverifiable else []})
        return out
