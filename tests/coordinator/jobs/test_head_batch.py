"""The output head shared by every job (coordinator.jobs.head_batch).

Bugs guarded: sixteen jobs on a ring cost sixteen LM-head products per token (issue 21);
batching them must not change any job's logits (SmolLM2: bitwise, the head's Linear
multiplies a row the same in every multi-row product), must not make a lone job wait,
must not let one job's bad rows fail the others, and must not leave the batcher stuck
when a waiting job is cancelled.
"""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch
import trio
import trio.testing

from coordinator.jobs.head_batch import EAGER_ROWS, HeadBatcher, accept_batched
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.sampling import SamplingParams
from coordinator.spec.target import accept_round
from shard.stage import OutputHead


def head_of(store) -> OutputHead:
    norm, lm_head = store.load_head()
    return OutputHead(store.config, norm, lm_head if lm_head is not None else store.load_embedding())


class GatedHead:
    """A real head whose first product waits until `release` is set (so asks pile up
    behind it), recording the rows of every product."""

    def __init__(self, head: OutputHead) -> None:
        self.head, self.release, self.products = head, threading.Event(), []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.products:
            assert self.release.wait(10)
        self.products.append(hidden.shape[0])
        return self.head.logits(hidden)


async def ask_all(batcher: HeadBatcher, asks: list[torch.Tensor], gate: GatedHead | None = None) -> list:
    """Every ask started at once (the first alone, the rest while its product runs);
    each result or the exception it raised."""
    out: list = [None] * len(asks)

    async def one(i: int) -> None:
        try:
            out[i] = await batcher.logits(asks[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[i] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(1, len(asks)):  # one at a time: trio runs tasks started together in any order
            nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
        if gate is not None:
            gate.release.set()
    return out


@pytest.mark.slow
def test_smollm2_batched_logits_equal_each_ask_alone_bitwise(smollm2_store):
    head = head_of(smollm2_store)
    g = torch.Generator().manual_seed(1)
    # SmolLM2's hidden states reach ~1e3: a last-bit difference in the product would show.
    asks = [torch.randn(n, smollm2_store.config.hidden_size, generator=g) * 300 for n in (1, 1, 3, 16, 1, 5)]
    gate = GatedHead(head)
    batcher = HeadBatcher(gate)
    got = trio.run(ask_all, batcher, asks, gate)
    assert gate.products == [1, sum(a.shape[0] for a in asks[1:])]  # the first alone, the rest in one product
    for hidden, logits in zip(asks, got):
        assert torch.equal(logits, head.logits(hidden))


def test_a_lone_ask_runs_at_once_alone(tiny_llama_store):
    head = head_of(tiny_llama_store)
    batcher = HeadBatcher(head)
    hidden = torch.randn(1, tiny_llama_store.config.hidden_size)

    async def main():
        with trio.fail_after(5):
            return await batcher.logits(hidden)

    assert torch.equal(trio.run(main), head.logits(hidden))
    assert (batcher.products, batcher.rows) == (1, 1)


def test_asks_waiting_share_one_product_within_max_rows(tiny_llama_store):
    head = head_of(tiny_llama_store)
    gate = GatedHead(head)
    batcher = HeadBatcher(gate, max_rows=4)
    asks = [torch.randn(n, tiny_llama_store.config.hidden_size) for n in (2, 1, 2, 1, 5, 1)]
    got = trio.run(ask_all, batcher, asks, gate)
    # The first alone; then, oldest first, as many as fit 4 rows (the oldest always, even of 5).
    assert gate.products == [2, 4, 5, 1]
    for hidden, logits in zip(asks, got):
        assert torch.allclose(logits, head.logits(hidden), rtol=0, atol=1e-5)


def test_an_ask_with_bad_rows_fails_alone(tiny_llama_store):
    head = head_of(tiny_llama_store)
    gate = GatedHead(head)
    batcher = HeadBatcher(gate)
    h = tiny_llama_store.config.hidden_size
    asks = [torch.randn(1, h), torch.randn(2, h), torch.randn(1, h + 3), torch.randn(3, h)]
    got = trio.run(ask_all, batcher, asks, gate)
    with pytest.raises(RuntimeError) as alone:
        head.logits(asks[2])
    assert isinstance(got[2], RuntimeError) and str(got[2]) == str(alone.value)
    for i in (0, 1, 3):
        assert torch.allclose(got[i], head.logits(asks[i]), rtol=0, atol=1e-5)


def test_a_waiting_ask_cancelled_leaves_the_batcher_working(tiny_llama_store):
    head = head_of(tiny_llama_store)
    gate = GatedHead(head)
    batcher = HeadBatcher(gate)
    h = tiny_llama_store.config.hidden_size
    hidden = [torch.randn(1, h) for _ in range(4)]

    async def main():
        results = {}

        async def ask(i):
            results[i] = await batcher.logits(hidden[i])

        waiting = trio.CancelScope()
        with trio.fail_after(10):  # ask 3 would wait forever behind a turn handed to ask 1
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, 0)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(_in_scope, waiting, ask, 1)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ask, 3)
                await trio.testing.wait_all_tasks_blocked()
                waiting.cancel()  # ask 1 leaves while it waits (it would have run the next product)
                await trio.testing.wait_all_tasks_blocked()
                gate.release.set()
        assert set(results) == {0, 3}
        with trio.fail_after(5):  # nothing is left holding the turn
            results[2] = await batcher.logits(hidden[2])
        return results

    results = trio.run(main)
    for i in (0, 2, 3):
        assert torch.equal(results[i], head.logits(hidden[i]))
    assert gate.products == [1, 1, 1]


async def _in_scope(scope: trio.CancelScope, fn, *args):
    with scope:
        await fn(*args)


@pytest.mark.parametrize("nodes", [3, EAGER_ROWS + 4])  # all rows up front; row by row from the worker thread
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_accept_batched_accepts_as_the_head_alone(tiny_llama_store, nodes, temperature):
    head = head_of(tiny_llama_store)
    batcher = HeadBatcher(head)
    g = torch.Generator().manual_seed(nodes)
    rows = torch.randn(nodes + 1, tiny_llama_store.config.hidden_size, generator=g)
    greedy = [int(t) for t in head.logits(rows).argmax(-1)]
    tree = DraftTree.chain(greedy[:nodes])  # the target's own choices: a long walk
    params = SamplingParams(temperature=temperature, seed=5)

    def accept(logits_of):
        return accept_round(tree, logits_of, params, 7, 40, [])

    want = accept(lambda r: head.logits(rows[r]))
    got = trio.run(partial(accept_batched, cheap=temperature == 0.0), batcher, rows, accept)  # greedy: no thread hop
    assert got[0] == want[0]
    assert batcher.rows <= nodes + 1


def test_then_runs_in_the_products_thread_and_its_error_stays_with_its_ask(tiny_llama_store):
    """A sampled round's acceptance rides its product's worker thread (one hop a product,
    not one more per job); a `then` that raises fails its own ask, not its batch-mates."""
    head = head_of(tiny_llama_store)
    gate = GatedHead(head)
    batcher = HeadBatcher(gate)
    h = tiny_llama_store.config.hidden_size
    asks = [torch.randn(1, h) for _ in range(4)]
    threads: list[int] = []

    def then(i: int, logits: torch.Tensor):
        threads.append(threading.get_ident())
        if i == 2:
            raise ValueError("bad round")
        return i, logits

    async def main():
        out: list = [None] * len(asks)

        async def one(i: int) -> None:
            try:
                out[i] = await batcher.logits_then(asks[i], partial(then, i))
            except ValueError as exc:
                out[i] = exc

        async with trio.open_nursery() as nursery:
            for i in range(len(asks)):  # the first alone, the rest in one product behind it
                nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked()
            gate.release.set()
        return out

    got = trio.run(main)
    assert gate.products == [1, 3]
    assert isinstance(got[2], ValueError) and str(got[2]) == "bad round"
    for i in (0, 1, 3):
        assert got[i][0] == i and torch.allclose(got[i][1], head.logits(asks[i]), rtol=0, atol=1e-5)
    assert threading.get_ident() not in threads and len(set(threads[1:])) == 1  # the second product's thread ran its 3
