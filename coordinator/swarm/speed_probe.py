"""A newcomer's compute speed, measured before formation seats it on what it claims.

A node registers with the decode and prefill speeds it measured itself, and the selector
would seat it on them: a node claiming 100x its real speed got seated and then missed
every deadline its claim made short. Before a registered node is eligible, the coordinator
runs real frames through it: VerifyRequests (shard.verifier's recompute, which every node
answers) for one layer its store keeps (`probe_layer`; a node keeping none is seated on its
claim: a probe would make it fetch weights) with random input rows, one of `decode_rows` rows and one of
`prefill_rows`, each timed from here, least of `repeats` (the first, which loads the layer
and may fetch it, is a warm-up and not timed). The reply's rows must match the
coordinator's own recompute of the same layer when its store holds it (row-RMS-scaled,
within `tolerance`); a node that does not answer, answers an error or disagrees is not
seated. The measured figures then cap the claim (`seated_speed`): a claim within `slack`x
of the measurement stands (the request's own overhead and the machine's load are in the
measurement), past that the measurement is used; a smaller lie is caught by the round
deadline its claim makes short (coordinator.jobs.deadline). The claim stays on the Member for
display; formation's snapshot carries the seated figure.

Pure: `per_layer_s`, `seated_speed`, `agrees`, `probe_layer`, `probe_frame`. `SpeedProbes`
is the thin I/O: it sends on the swarm's control streams (`send`) and is handed the replies
the swarm reads (`answer`). It does not form rings or judge lies beyond its one probe
(probation and audits do).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ring import PeerId
from shard.errors import ShardError
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.quant import quantise_stage, scheme
from shard.replay import replay
from shard.stage import Stage
from shard.store import ModelStore
from shard.wire.codec import encode, encode_body
from shard.wire.messages import Forward, Register
from shard.wire.verify import VerifyReply, VerifyRequest

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
    timeout_s: float = 120.0  # for the whole probe: the warm-up may fetch the layer first


@dataclass(frozen=True)
class Measured:
    layer: int
    decode_s_per_layer: float
    prefill_s_per_layer_token: float
    checked: bool  # its rows were compared with the coordinator's own recompute


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


def agrees(theirs: torch.Tensor, ours: torch.Tensor, tolerance: float) -> bool:
    """Whether each row of `theirs` (N, H) is within `tolerance` of `ours`, scaled by our row's RMS."""
    if theirs.shape != ours.shape or not bool(torch.isfinite(theirs).all()):
        return False
    rms = ours.float().pow(2).mean(dim=1).sqrt().clamp_min(1e-6)  # (N,)
    return bool(((theirs.float() - ours.float()).abs().amax(dim=1) / rms).max() <= tolerance)


def probe_layer(reg: Register, num_layers: int) -> int | None:
    """The layer to time: one the node holds past the embedding's layer 0 (whose input is
    tokens), else one past 0 its store keeps; None when its store keeps no such layer (a
    probe would make it fetch one: it is seated on its claim, and `summary` says so)."""
    if reg.held_end > max(reg.held_start, 1):
        return max(reg.held_start, 1)
    stored = set(reg.stored_files)
    return next((i for i in range(1, num_layers) if layer_file(i) in stored), None)


def probe_frame(hidden_size: int, rows: int, seed: bytes) -> Forward:
    """A prefill frame of `rows` random hidden rows at positions [0, rows)."""
    g = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return Forward(job_id=PROBE_JOB_ID, epoch=0, round=0, nonce=seed, phase="prefill", ctx_len=0,
                   positions=torch.arange(rows, dtype=torch.int64), hidden=torch.randn(rows, hidden_size, generator=g))


class ProbeFailed(ShardError):
    pass


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
                "seated_on_claim_no_layer_stored": sorted(self.unprobed)}

    async def _probe(self, peer: PeerId, reg: Register) -> None:
        try:
            with trio.fail_after(self.config.timeout_s):
                m = await self._measure(peer, reg)
            if m is None:
                self.unprobed.add(peer)
                log.warning("node %s seated on its claimed speed: its store keeps no layer to time", peer)
            else:
                self.measured[peer] = m
                log.info("node %s probed on layer %d: decode %.2f ms/layer (claimed %.2f), prefill %.3f ms/layer-token "
                         "(claimed %.3f)%s", peer, m.layer, m.decode_s_per_layer * 1e3, reg.decode_s_per_layer * 1e3,
                         m.prefill_s_per_layer_token * 1e3, reg.prefill_s_per_layer_token * 1e3,
                         "" if m.checked else "; rows unchecked (this store lacks the layer)")
        except (ShardError, trio.TooSlowError) as exc:
            why = str(exc) if isinstance(exc, ShardError) else f"no answer within {self.config.timeout_s:.0f} s"
            self.failed[peer] = f"speed probe failed: {why}"
            log.warning("node %s not seated: %s", peer, self.failed[peer])
        finally:
            self._running.discard(peer)
        self.notify()

    async def _measure(self, peer: PeerId, reg: Register) -> Measured | None:
        cfg, layer = self.config, probe_layer(reg, self.store.config.num_layers)
        if layer is None:
            return None
        hidden = self.store.config.hidden_size
        prefill, decode = probe_frame(hidden, cfg.prefill_rows, os.urandom(16)), probe_frame(hidden, cfg.decode_rows, os.urandom(16))
        theirs, _ = await self._ask(peer, layer, reg, prefill)  # warm-up: loads (or fetches) the layer
        checked = (self.store.root / layer_file(layer)).exists()
        if checked:
            ours = await trio.to_thread.run_sync(self._recompute, layer, reg.quant, prefill)
            if not agrees(theirs, ours, cfg.tolerance):
                raise ProbeFailed(f"its rows for layer {layer} differ from the coordinator's recompute "
                                  f"beyond {cfg.tolerance} of a row's RMS")
        idle = min([await self._ask_nothing(peer, layer) for _ in range(cfg.repeats)])
        times = {}
        for name, frame in (("decode", decode), ("prefill", prefill)):
            times[name] = min([(await self._ask(peer, layer, reg, frame))[1] for _ in range(cfg.repeats)])
        return Measured(layer, per_layer_s(times["decode"], idle, 1, cfg.decode_rows),
                        per_layer_s(times["prefill"], idle, 1, cfg.prefill_rows), checked)

    async def _ask_nothing(self, peer: PeerId, layer: int) -> float:
        """Seconds a request the node refuses at once takes: the link's round trip and the
        control path's own cost, taken off the timed requests."""
        req = VerifyRequest(request_id=next(self._ids), layer_start=layer, layer_end=layer + 1, wire_dtype=self.wire_dtype,
                            frame_bytes=(1,), frames=torch.zeros(1, dtype=torch.uint8))  # not a frame: refused unread
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
            raise ProbeFailed(f"it could not run layer {layer}: {reply.error}")
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
