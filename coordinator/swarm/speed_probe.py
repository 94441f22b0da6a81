"""A newcomer's compute speed, measured before formation seats it on what it claims.

A node registers with the decode and prefill speeds it measured itself, and the selector
would seat it on them: a node claiming 100x its real speed got seated and then missed
every deadline its claim made short. Before a registered node is eligible, the coordinator
runs real frames through it: VerifyRequests (shard.verifier's recompute, which every node
answers) for one layer (`probe_layer`: one it holds or stores; a node storing none is
probed all the same, on a layer whose rows can be checked, which it fetches from peers
first: seated on its claim, a staller with an empty store went unprobed) with random
input rows, one of `decode_rows` rows and one of `prefill_rows`, each timed from here,
least of `repeats` (the first, which loads the layer and may fetch it, is a warm-up and
not timed). The reply's rows must match the coordinator's own recompute of the same layer
when its store holds it, else a verifier's: another member already probed (checked ones
first) whose store keeps the layer, asked the same request (row-RMS-scaled, within
`tolerance`). A newcomer that disagrees with one verifier is asked about by a second when
there is one, and is not seated unless one agrees: the members probed before it are
trusted over it (audits keep watching them). With neither, the rows stay unchecked
(`Measured.checked_by` is empty). A node that answers wrong rows is not seated; one that
does not answer in time, loses its stream or answers an error is probed again, up to
`attempts` in all, `retry_after_s` apart (doubling), before it is not seated either. The measured figures then cap the claim (`seated_speed`): a claim within `slack`x
of the measurement stands (the request's own overhead and the machine's load are in the
measurement), past that the measurement is used, once it read so again on `confirm_rounds` more rounds
of requests (least kept: a probe on a loaded machine reads high now and then); a smaller lie is caught by the round
deadline its claim makes short (coordinator.jobs.deadline). The claim stays on the Member for
display; formation's snapshot carries the seated figure.

Pure: `per_layer_s`, `seated_speed`, `past_slack`, `agrees`, `probe_layer`, `probe_frame`. `SpeedProbes`
is the thin I/O: it sends on the swarm's control streams (`send`) and is handed the replies
the swarm reads (`answer`). It does not form rings or judge lies beyond its one probe
(probation and audits do).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ring import PeerId
from shard.errors import ShardError, TransportError
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.quant import quantise_stage, scheme
from shard.replay import replay
from shard.stage import Stage
from shard.store import ModelStore
from shard.wire.codec import encode, encode_body
from shard.wire.messages import Forward, Register
from shard.wire.verify import VerifyReply, VerifyRequest, timing_request

log = logging.getLogger("shard.coordinator")

PROBE_JOB_ID = "speed-probe"


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = True  # False: seat nodes on their claimed speeds (tests that pin a plan on claims)
    decode_rows: int = 1
    prefill_rows: int = 64
    repeats: int = 3  # timed requests of each kind; the least counts
    # A claim up to this many times faster than measured stands: the probe's own overhead
    # (decode, a thread hop, f32 replay) read 3-4x a tiny test model's own measurement.
    slack: float = 10.0
    tolerance: float = 1e-2  # largest |reply - ours| per row over our row's RMS
    timeout_s: float = 120.0  # for one attempt at the whole probe: the warm-up may fetch the layer first
    # A probe that timed out, lost its stream or was answered an error (a fetch that
    # failed, a node still loading) is tried again, up to this many attempts in all.
    attempts: int = 3
    retry_after_s: float = 2.0  # before the second attempt; doubling after
    verifiers: int = 2  # other members asked to recompute the rows when this store lacks the layer
    # A reading past `slack` is taken again this many times, `confirm_after_s` apart, least
    # kept, before it replaces the claim: three local-ring nodes probed while the others
    # loaded read one honest node's decode at 23.3 ms per layer against its 0.69 claimed
    # (34x; its neighbours 0.00), and seated so it was given 1 layer of 30 (split 15/1/14).
    confirm_rounds: int = 2
    confirm_after_s: float = 0.5


@dataclass(frozen=True)
class Measured:
    layer: int
    decode_s_per_layer: float
    prefill_s_per_layer_token: float
    checked: bool  # its rows were compared with a recompute (the coordinator's or a verifier's) and agreed
    checked_by: str = ""  # "coordinator", a verifier's peer id, or "" (nobody could recompute the layer)


def per_layer_s(reply_s: float, idle_s: float, layers: int, rows: int = 1) -> float:
    """Seconds per layer (and per row) of a timed request: its time less that of a request
    with no work (the link's round trip and the control path's own cost)."""
    return max(reply_s - idle_s, 0.0) / (layers * rows)


def transfer_s(request_bytes: int, reply_bytes: int, download_bytes_per_s: float, upload_bytes_per_s: float) -> float:
    """Seconds a timed request spends on the node's links (the request down, its rows up):
    not compute. A rate <= 0 (unmeasured) counts as free."""
    down = request_bytes / download_bytes_per_s if download_bytes_per_s > 0 else 0.0
    return down + (reply_bytes / upload_bytes_per_s if upload_bytes_per_s > 0 else 0.0)


def seated_speed(claimed_s: float, measured_s: float, slack: float) -> float:
    """The seconds the selector uses: the claim while it is within `slack`x of the
    measurement (never a slower figure than claimed: an honest node keeps its own), else
    the measurement."""
    return claimed_s if measured_s <= slack * claimed_s else measured_s


def past_slack(reg: Register, m: Measured, slack: float) -> bool:
    """Whether a measurement would replace the node's claim (decode or prefill): the
    reading the probe takes again before it is believed."""
    return (seated_speed(reg.decode_s_per_layer, m.decode_s_per_layer, slack) != reg.decode_s_per_layer
            or seated_speed(reg.prefill_s_per_layer_token, m.prefill_s_per_layer_token, slack) != reg.prefill_s_per_layer_token)


def agrees(theirs: torch.Tensor, ours: torch.Tensor, tolerance: float) -> bool:
    """Whether each row of `theirs` (N, H) is within `tolerance` of `ours`, scaled by our row's RMS."""
    if theirs.shape != ours.shape or not bool(torch.isfinite(theirs).all()):
        return False
    rms = ours.float().pow(2).mean(dim=1).sqrt().clamp_min(1e-6)  # (N,)
    return bool(((theirs.float() - ours.float()).abs().amax(dim=1) / rms).max() <= tolerance)


def keeps(reg: Register, layer: int) -> bool:
    """Whether a node holds `layer` loaded or its store has the layer's file."""
    return reg.held_start <= layer < reg.held_end or layer_file(layer) in reg.stored_files


def probe_layer(reg: Register, num_layers: int, checkable: Iterable[int] = ()) -> int | None:
    """The layer to time: one the node holds past the embedding's layer 0 (whose input is
    tokens), else one past 0 its store keeps, else (it keeps none: it fetches the layer
    first) the first of `checkable` past 0 (layers whose rows the coordinator or a verifier
    can recompute), else layer 1. None only for a model with no layer past 0."""
    if reg.held_end > max(reg.held_start, 1):
        return max(reg.held_start, 1)
    stored = set(reg.stored_files)
    kept = next((i for i in range(1, num_layers) if layer_file(i) in stored), None)
    if kept is not None or num_layers < 2:
        return kept
    return next((i for i in checkable if 1 <= i < num_layers), 1)


def retry_wait_s(attempt: int, config: ProbeConfig) -> float | None:
    """Seconds to wait before attempt `attempt + 1` after attempt `attempt` (0-based)
    failed for want of an answer; None when the attempts are used up."""
    return config.retry_after_s * 2 ** attempt if attempt + 1 < config.attempts else None


def probe_frame(hidden_size: int, rows: int, seed: bytes) -> Forward:
    """A prefill frame of `rows` random hidden rows at positions [0, rows)."""
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return Forward(job_id=PROBE_JOB_ID, epoch=0, round=0, nonce=seed, phase="prefill", ctx_len=0,
                   positions=torch.arange(rows, dtype=torch.int64), hidden=torch.randn(rows, hidden_size, generator=g))


class ProbeFailed(ShardError):
    """`retry`: the node did not answer usably (an error reply), rather than answered wrong rows."""

    def __init__(self, what: str, retry: bool = False) -> None:
        super().__init__(what)
        self.retry = retry


class SpeedProbes:
    """Probes each registered node once per identity (kept for the coordinator's life)."""

    def __init__(self, store: ModelStore, config: ProbeConfig, wire_dtype: str, max_reply_bytes: int,
                 send: Callable[[PeerId, object], Awaitable[None]], notify: Callable[[], None]) -> None:
        """`send(peer, msg)`: on its control stream; `notify()`: eligibility changed."""
        self.store, self.config, self.wire_dtype, self.max_reply_bytes = store, config, wire_dtype, max_reply_bytes
        self.send, self.notify = send, notify
        self.measured: dict[PeerId, Measured] = {}
        self.failed: dict[PeerId, str] = {}
        self.unprobed: set[PeerId] = set()  # stores no layer to time: seated on its claim
        self._running: set[PeerId] = set()
        self._queued: list[tuple[PeerId, Register]] = []
        self._nursery: trio.Nursery | None = None
        self._waiting: dict[tuple[PeerId, int], list] = {}
        self._ids = itertools.count(1 << 40)  # apart from the auditor's request ids
        self.attempts: dict[PeerId, int] = {}  # attempts the last probe of each peer took
        self._registers: dict[PeerId, Register] = {}  # the members at the last hold_back: verifier candidates

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run probes as nodes register. Never returns."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for item in self._queued:
                nursery.start_soon(self._probe, *item)
            self._queued.clear()
            task_status.started()
            await trio.sleep_forever()

    def begin(self, peer: PeerId, reg: Register) -> None:
        """Probe `peer` unless it was measured, failed or is being probed."""
        if not self.config.enabled or peer in self.measured or peer in self.failed or peer in self.unprobed or peer in self._running:
            return
        self._running.add(peer)
        if self._nursery is None:
            self._queued.append((peer, reg))
        else:
            self._nursery.start_soon(self._probe, peer, reg)

    def hold_back(self, members: Mapping[PeerId, Any]) -> dict[PeerId, str]:
        """Of `members` (peer -> anything with a `.register`), those formation must not seat
        yet, with why; starts a probe of each one not yet probed."""
        if not self.config.enabled:
            return {}
        self._registers = {p: m.register for p, m in members.items()}
        for p, m in members.items():
            self.begin(p, m.register)
        return {p: self.failed.get(p, "speed probe pending") for p in members if p not in self.measured and p not in self.unprobed}

    def answer(self, peer: PeerId, msg: object) -> bool:
        """Take `msg` if it answers one of our probes (True), else leave it to others."""
        slot = self._waiting.get((peer, getattr(msg, "request_id", -1))) if isinstance(msg, VerifyReply) else None
        if slot is None:
            return False
        slot[1] = msg
        slot[0].set()
        return True

    def seated(self, peer: PeerId, reg: Register) -> Register:
        """`reg` with the speeds the selector may use (the claim capped by the measurement)."""
        m = self.measured.get(peer)
        if m is None:
            return reg
        s = self.config.slack
        return dataclasses.replace(
            reg, decode_s_per_layer=seated_speed(reg.decode_s_per_layer, m.decode_s_per_layer, s),
            prefill_s_per_layer_token=seated_speed(reg.prefill_s_per_layer_token, m.prefill_s_per_layer_token, s))

    def summary(self) -> dict:
        return {"measured": {p: dataclasses.asdict(m) for p, m in self.measured.items()}, "failed": dict(self.failed),
                "seated_on_claim_no_layer_past_0": sorted(self.unprobed), "attempts": dict(self.attempts)}

    async def _probe(self, peer: PeerId, reg: Register) -> None:
        try:
            attempt = 0
            while True:
                self.attempts[peer] = attempt + 1
                try:
                    with trio.fail_after(self.config.timeout_s):
                        m = await self._measure(peer, reg)
                    break
                except (TransportError, ProbeFailed, trio.TooSlowError) as exc:
                    wait_s = retry_wait_s(attempt, self.config)
                    if isinstance(exc, ProbeFailed) and not exc.retry or wait_s is None or peer not in self._registers:
                        raise
                    log.info("speed probe of %s: attempt %d failed (%s); again in %.0f s", peer, attempt + 1,
                             exc if isinstance(exc, ShardError) else "timed out", wait_s)
                    await trio.sleep(wait_s)
                    attempt += 1
            if m is None:
                self.unprobed.add(peer)
                log.warning("node %s seated on its claimed speed: the model has no layer past 0 to time", peer)
            else:
                self.measured[peer] = m
                log.info("node %s probed on layer %d: decode %.2f ms/layer (claimed %.2f), prefill %.3f ms/layer-token "
                         "(claimed %.3f); rows %s", peer, m.layer, m.decode_s_per_layer * 1e3, reg.decode_s_per_layer * 1e3,
                         m.prefill_s_per_layer_token * 1e3, reg.prefill_s_per_layer_token * 1e3,
                         f"checked by {m.checked_by}" if m.checked else "unchecked (nobody could recompute the layer)")
        except (ShardError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, ShardError) else f"no answer within {self.config.timeout_s:.0f} s"
            tries = self.attempts.get(peer, 1)
            self.failed[peer] = f"speed probe failed{f' {tries} times' if tries > 1 else ''}: {why}"
            log.warning("node %s not seated: %s", peer, self.failed[peer])
        finally:
            self._running.discard(peer)
        self.notify()

    def _checkable(self, peer: PeerId, num_layers: int) -> list[int]:
        """Layers past 0 whose rows can be recomputed for a probe of `peer`: this store's
        first, then those a probed member other than `peer` keeps."""
        here = [i for i in range(1, num_layers) if self.holds(i)]
        there = [i for i in range(1, num_layers) if any(keeps(r, i) for p, r in self._registers.items()
                                                         if p != peer and p in self.measured)]
        return here + there

    def holds(self, layer: int) -> bool:
        return (self.store.root / layer_file(layer)).exists()

    def _verifiers(self, peer: PeerId, layer: int) -> list[PeerId]:
        """Members other than `peer`, already probed, keeping `layer`: checked ones first."""
        found = [p for p, r in self._registers.items() if p != peer and p in self.measured and keeps(r, layer)]
        return sorted(found, key=lambda p: not self.measured[p].checked)[:self.config.verifiers]

    async def _check(self, peer: PeerId, layer: int, reg: Register, frame: Forward, theirs: torch.Tensor) -> str:
        """Who vouched for `theirs` ("" when nobody could recompute the layer). Raises
        ProbeFailed when the recomputations that came back all disagree with it."""
        tol = self.config.tolerance
        if self.holds(layer):
            ours = await trio.to_thread.run_sync(self._recompute, layer, reg.quant, frame)
            if not agrees(theirs, ours, tol):
                raise ProbeFailed(f"its rows for layer {layer} differ from the coordinator's recompute "
                                  f"beyond {tol} of a row's RMS")
            return "coordinator"
        disagreed = []
        for verifier in self._verifiers(peer, layer):
            try:
                with trio.fail_after(self.config.timeout_s):
                    rows, _ = await self._ask(verifier, layer, reg, frame)
            except (TransportError, ProbeFailed, trio.TooSlowError) as exc:
                log.info("verifier %s could not recompute layer %d for %s's probe: %s", verifier, layer, peer,
                         exc if isinstance(exc, ShardError) else "timed out")
                continue
            if agrees(theirs, rows, tol):
                return verifier
            disagreed.append(verifier[-6:])
        if disagreed:
            raise ProbeFailed(f"its rows for layer {layer} differ from the recompute of verifier(s) "
                              f"{', '.join(disagreed)} beyond {tol} of a row's RMS")
        return ""

    async def _measure(self, peer: PeerId, reg: Register) -> Measured | None:
        num_layers = self.store.config.num_layers
        cfg, layer = self.config, probe_layer(reg, num_layers, self._checkable(peer, num_layers))
        if layer is None:
            return None
        hidden = self.store.config.hidden_size
        prefill, decode = probe_frame(hidden, cfg.prefill_rows, os.urandom(16)), probe_frame(hidden, cfg.decode_rows, os.urandom(16))
        theirs, _ = await self._ask(peer, layer, reg, prefill)  # warm-up: loads (or fetches) the layer
        checked_by = await self._check(peer, layer, reg, prefill, theirs)
        idle, times = math.inf, {"decode": math.inf, "prefill": math.inf}
        for attempt in range(cfg.confirm_rounds + 1):
            if attempt:
                await trio.sleep(cfg.confirm_after_s)
            idle = min(idle, *[await self._ask_nothing(peer, layer) for _ in range(cfg.repeats)])
            for name, frame in (("decode", decode), ("prefill", prefill)):
                times[name] = min(times[name], *[(await self._ask(peer, layer, reg, frame))[1] for _ in range(cfg.repeats)])
            m = Measured(layer, per_layer_s(times["decode"], idle, 1, cfg.decode_rows),
                         per_layer_s(times["prefill"], idle, 1, cfg.prefill_rows), bool(checked_by), checked_by)
            if not past_slack(reg, m, cfg.slack):
                break
        return m

    async def _ask_nothing(self, peer: PeerId, layer: int) -> float:
        """Seconds a request the node refuses at once takes: the link's round trip and the
        control path's own cost, taken off the timed requests."""
        req = timing_request(next(self._ids), layer, self.wire_dtype)  # answered at once, with an error
        start = time.perf_counter()
        await self._exchange(peer, req)
        return time.perf_counter() - start

    async def _ask(self, peer: PeerId, layer: int, reg: Register, frame: Forward) -> tuple[torch.Tensor, float]:
        """The rows `peer` recomputed for `frame` on `layer` and the seconds it took, less the
        request's and the reply's transfer at the node's link rates."""
        quant = reg.quant
        body = encode_body(frame)
        rid = next(self._ids)
        req = VerifyRequest(request_id=rid, layer_start=layer, layer_end=layer + 1, quant=quant, wire_dtype=self.wire_dtype,
                            max_replay_rows=max(frame.positions.shape[0], 1), max_reply_bytes=self.max_reply_bytes,
                            frame_bytes=(len(body),), frames=torch.frombuffer(bytearray(body), dtype=torch.uint8))
        start = time.perf_counter()
        reply = await self._exchange(peer, req)
        elapsed = time.perf_counter() - start
        if reply.error is not None:
            raise ProbeFailed(f"it could not run layer {layer}: {reply.error}", retry=True)
        if reply.hidden is None or reply.hidden.shape[0] == 0:
            raise ProbeFailed(f"it answered no rows for layer {layer}")
        moved = transfer_s(len(encode(req)), len(encode(reply)), reg.download_bytes_per_s, reg.upload_bytes_per_s)
        return reply.hidden, max(elapsed - moved, 0.0)

    async def _exchange(self, peer: PeerId, req: VerifyRequest) -> VerifyReply:
        slot = self._waiting[(peer, req.request_id)] = [trio.Event(), None]
        try:
            await self.send(peer, req)
            await slot[0].wait()
        finally:
            self._waiting.pop((peer, req.request_id), None)
        return slot[1]

    def _recompute(self, layer: int, quant: str, frame: Forward) -> torch.Tensor:
        r = LayerRange(layer, layer + 1)
        stage = quantise_stage(Stage(self.store.config, r, self.store.load_layers(r, torch.float32, "cpu"),
                                     dtype=torch.float32, device="cpu"), scheme(quant))
        out = replay(stage, self.wire_dtype, [frame], frame.positions.shape[0], frame_by_frame=scheme(quant).quantised)[0]
        if out is None:
            raise ProbeFailed("the coordinator's recompute kept no row")
        return out[1]  # (rows, H)
