"""K/V room on rings (coordinator/jobs/kv_room.py) and the router's use of it: a full ring
takes no new job, a job waits for room and moves to a ring with room, a refusal teaches."""

from __future__ import annotations

from types import SimpleNamespace

import dataclasses

import trio
import trio.testing

from coordinator.jobs.kv_room import Room, StageRoom, job_slots
from coordinator.jobs.ring_router import RingRouter
from shard.kv_budget import MIN_KV_BYTES, stage_kv_bytes
from shard.kvcache import INITIAL_SLOTS, KVCache

import torch

from tests.coordinator.jobs.test_ring_router import Rings


def test_job_slots_follow_the_caches_doubling():
    assert job_slots(10, 4096, 256) == INITIAL_SLOTS
    assert job_slots(257, 4096, 256) == 512
    assert job_slots(1500, 4096, 256) == 2048
    assert job_slots(5000, 4096, 256) == 4096  # never past max_slots
    assert job_slots(1200, 4096, 1000) == 2398  # frames of 1000 grow it to 1000, then to 2000: bounded by 2 x


def test_job_slots_equal_what_a_real_cache_reserves():
    # Bug guarded: estimating n slots where the cache holds the doubling step past n.
    for tokens, step in ((300, 64), (700, 256), (1000, 900), (1200, 1000), (1900, 999)):
        cache = KVCache(2, 1, 4, torch.float32, 1 << 30)
        job = cache.open("j", 4096)
        for end in range(step, tokens + step, step):
            job.ensure(min(end, tokens))
        assert cache.reserved_bytes // cache.bytes_per_slot <= job_slots(tokens, 4096, step)
        assert job.capacity == job_slots(tokens, 4096, step) or step > INITIAL_SLOTS


def test_stage_kv_bytes_mirror_the_node_with_its_floor():
    assert stage_kv_bytes(1 << 30, 1 << 29) == 1 << 29
    assert stage_kv_bytes(100 << 20, 90 << 20) == MIN_KV_BYTES


def test_room_fits_by_bytes_on_every_stage_by_open_jobs_and_by_what_refusals_taught():
    stages = (StageRoom(1000 * 10, 10), StageRoom(1000 * 20, 20))  # 1000 slots each
    assert Room(stages, [256, 256, 256]).fits(232) and not Room(stages, [256, 256, 256]).fits(256)
    assert not Room((StageRoom(10 ** 9, 10, max_jobs=2),), [1, 1]).fits(1)
    assert not Room(stages, [256], learned_jobs=1).fits(1) and Room(stages, [], learned_jobs=1).fits(256)
    assert not Room(stages, []).could_ever_fit(1001) and Room(stages, [900]).could_ever_fit(1000)


def _swarm(kv_slots: int, kv_per_layer: int = 1024) -> Rings:
    """Two rings of two stages, each stage's K/V holding `kv_slots` slots of its 2 layers
    (never under MIN_KV_BYTES' worth)."""
    swarm = Rings()
    swarm.model = dataclasses.replace(swarm.model, kv_bytes_per_token_layer=kv_per_layer)
    swarm.add(0, 3, ("a", "b"))
    swarm.add(1, 4, ("c", "d"))
    per_slot = 2 * swarm.model.kv_bytes_per_token_layer
    reg = SimpleNamespace(memory_bytes=2 * 1000 + kv_slots * per_slot, bytes_per_layer=1000)
    swarm.members = {p: SimpleNamespace(register=reg) for p in "abcd"}
    return swarm


def test_draft_slack_counts_only_where_a_drafter_writes_past_the_tokens():
    # 50 prompt + 128 new tokens: 178 slots fit the cache's first 256 with no drafter; the
    # 128 slots a drafter may write past them take it to its first doubling, 512.
    pin = SimpleNamespace(prompt_tokens=50, max_tokens=128)
    swarm = _swarm(100)
    assert RingRouter(swarm, kv_slack=0).slots(pin) == 256
    assert RingRouter(swarm, kv_slack=128).slots(pin) == 512


def test_a_full_ring_takes_no_new_job_while_another_has_room():
    swarm = _swarm(100)  # under the floor: MIN_KV_BYTES hold 32768 slots a stage
    router = RingRouter(swarm)
    per_ring = 32768 // 256
    rings = [router.route(f"j{i}", 10, 64).ring_id for i in range(2 * per_ring)]
    assert rings.count(0) == rings.count(1) == per_ring
    pin = router.pinned["j0"]
    assert not router.fits(0, router.pinned.setdefault("x", type(pin)(-1, 10, 64)))


def test_a_job_waits_for_room_and_runs_when_one_finishes_or_times_out():
    trio.run(_waits_for_room)


async def _waits_for_room():
    swarm = _swarm(32768)
    router = RingRouter(swarm)
    for i in range(256):
        router.route(f"j{i}", 10, 64)
    router.route("late", 10, 64)
    assert not await router.wait_room("late", 0.01)  # nothing finished: the wait runs out (429 upstream)
    got = []

    async def wait():
        got.append(await router.wait_room("late", 5.0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        router.forget("j3")  # a job on ring 0 finished
    assert got == [True] and router.pinned["late"].ring_id == router.pinned["j3"].ring_id


def test_a_refusal_caps_the_ring_at_the_jobs_it_held_and_the_refused_job_moves_where_there_is_room():
    trio.run(_refusal_teaches)


async def _refusal_teaches():
    swarm = _swarm(1 << 20)  # the estimate says plenty
    router = RingRouter(swarm)
    for i in range(4):
        router.route(f"j{i}", 10, 64)  # two a ring
    victim = next(j for j, p in router.pinned.items() if p.ring_id == 0 and j != "j0")
    router.refused(victim)  # ring 0's stage says no: it holds no more than the other one there
    assert router.learned_jobs[3][0] == 1 and router.kv_refusals == 1
    assert await router.wait_room(victim, 1.0) and router.pinned[victim].ring_id == 1
    assert router.route("new", 10, 64).ring_id == 1  # ring 0 is full as taught


def test_a_job_no_ring_could_ever_hold_is_sent_at_once_for_its_stages_to_decide():
    router = RingRouter(_swarm(1, kv_per_layer=1 << 20))  # 32 slots a stage: not one job's first 256

    async def main():
        router.route("big", 10, 64)
        with trio.fail_after(0.5):
            assert await router.wait_room("big", 10.0)
    trio.run(main)




def test_jobs_waiting_for_room_go_first_come_first_served():
    # Bug guarded: a waiter woken later (or a newcomer) taking the room an earlier one waits for.
    swarm = _swarm(32768)
    router = RingRouter(swarm)
    for i in range(256):
        router.route(f"j{i}", 10, 64)  # both rings full
    order: list[str] = []

    async def wait(job_id):
        router.route(job_id, 10, 64)
        assert await router.wait_room(job_id, 5.0)
        order.append(job_id)

    async def main():
        async with trio.open_nursery() as nursery:
            for name in ("w1", "w2", "w3"):
                nursery.start_soon(wait, name)
                await trio.testing.wait_all_tasks_blocked()
            router.forget("j0")  # room for one: the first in line, however the waiters wake
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["w1"]
            router.forget("j1")
            router.forget("j2")
    trio.run(main)
    assert order == ["w1", "w2", "w3"]


def test_a_head_stage_counts_its_resident_embedding_on_the_node_and_at_the_gateway(tiny_llama_store):
    # Bug guarded: the head stage copies its embedding into its own memory (load_stage), but
    # its K/V bytes were its memory less its layers only, so both the node's cache and the
    # gateway's prediction of its room overstated it by the embedding's bytes.
    from shard.kv_budget import node_kv_bytes, stage_weight_bytes
    from shard.layers import LayerRange
    from shard.node import NodeConfig
    store, memory = tiny_llama_store, 64 << 20
    embedding = store.embedding_bytes()
    head, middle = LayerRange(0, 2), LayerRange(2, 4)
    tensor = store.load_embedding().numel() * 4  # f32: what the node holds
    assert tensor <= embedding <= tensor + 4096  # as stored: the tensor and its file's header
    assert stage_weight_bytes(store, head, 0) == store.layer_bytes(head) + embedding
    assert stage_weight_bytes(store, middle, 0) == store.layer_bytes(middle)
    assert stage_weight_bytes(store, head, 1000) == 2000 + embedding  # held bytes of quantised layers
    config = NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1", model=store.manifest.name, max_memory_bytes=MIN_KV_BYTES + memory)
    assert node_kv_bytes(config, store, head) == stage_kv_bytes(config.max_memory_bytes, store.layer_bytes(head) + embedding)
    assert node_kv_bytes(config, store, head) == node_kv_bytes(config, store, LayerRange(2, 4)) - embedding
