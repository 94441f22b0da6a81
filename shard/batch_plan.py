"""Which of the frames waiting at a stage run together in its next forward, and how many
rows of each (issue 21).

Pure: given the waiting frames in arrival order as (job id, rows left, splittable), it picks
the batch for Stage.forward_batch / StageWorker.process_frames under a token budget shared
by prefill chunks and decode rows, and cuts a long prefill chunk into consecutive pieces
while decode rows are about, so they never wait behind a whole chunk's forward. It never
waits for company: the batch is chosen from what is waiting now. Does not know tensors,
caches, the wire, clocks or how frames arrived.

Prefill order: the prefill rows of a forward go to the waiting prefill chunks shortest
remaining prompt first (the rows left of a job's chunk plus its later chunks waiting here:
what the stage knows; the Forward does not say how long the whole prompt is, and a later
stage sees a job's chunks one by one), so a short prompt does not queue behind a long one's
pieces. Aging bounds a long prompt's wait: a chunk passed over (no rows while it was its
job's first waiting frame) in `max_passes` forwards since it last got rows goes ahead of
every chunk passed over less, the oldest of those first, so the oldest frame runs within
`max_passes` + 1 forwards and any chunk gets a piece at least every `max_passes` + J
forwards (J: the prefill jobs waiting). `passed_over` keeps that count; "arrival" serves
prefill oldest first instead (the order before; a knob for comparing them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# Rows one forward may carry: one full prefill chunk (256 tokens, the coordinator's
# largest, coordinator.jobs.engine_config) plus 64 decode or verify rows beside it.
DEFAULT_TOKEN_BUDGET = 320
# Prefill rows one forward carries while decode rows are about. Measured on 10 of SmolLM2's
# 30 layers (one thread, this 2-core VM, load ~5): 16 decode rows alone 26 ms, with a
# 64-row piece beside them 86 ms, with a whole 256-row chunk 253 ms; pieces of 64 keep a
# forward that carries decode rows near 3x their own cost instead of ~10x
# (scripts/bench_batch.py: prefill_beside_decode in docs/results/bench_batch.json).
DEFAULT_PIECE_ROWS = 64
# Prefill orders: shortest remaining first with aging (the default), or oldest first.
PREFILL_ORDERS = ("shortest", "arrival")
# Forwards a prefill chunk may be passed over before it goes ahead of shorter ones: a
# 1.9k-token prompt is ~30 pieces of 64, so under a steady stream of short prompts it still
# gets a piece at least every 9 forwards of the stage (~1 s at 16 streams on this VM), while
# a short prompt arriving behind it waits for at most the aged ones' pieces.
DEFAULT_MAX_PASSES = 8


def plan_batch(waiting: Sequence[tuple[str, int, bool]], token_budget: int = DEFAULT_TOKEN_BUDGET,
               piece_rows: int = DEFAULT_PIECE_ROWS, busy: bool = False, passed: Mapping[str, int] | None = None,
               order: str = "shortest", max_passes: int = DEFAULT_MAX_PASSES) -> list[tuple[int, int]]:
    """(index into `waiting`, rows to run now) of the frames to run next, in arrival order.

    `waiting`: (job id, rows still to run, splittable) in arrival order; splittable marks a
    prefill chunk that may run as consecutive pieces (a causal chunk computed piece by
    piece is the same maths: each piece attends to the cache rows the earlier ones wrote).
    `passed`: job id -> forwards its first waiting frame was passed over (passed_over).

    Only a job's first waiting frame can run (a job's next frame needs the K/V its earlier
    one writes), at most one frame per job. The frames are considered in arrival order,
    except that the places of the prefill chunks among them go to the chunks in prefill
    order (module docstring; `order`). The first place always runs, even past the budget
    (alone, then): the oldest frame, or the first chunk in prefill order where the oldest
    is a chunk. Each later frame joins while its rows fit what is left. A frame that does
    not fit is passed over, not a wall: smaller frames behind it still join. Splitting:
    while decode rows wait (a frame that is not splittable and has rows) or `busy` (the
    caller saw decode rows lately), the splittable frames of one forward carry at most
    `piece_rows` rows together, in prefill order; otherwise a prefill chunk runs whole, so
    a lone job's prompt costs what it did. piece_rows 0: never split.
    """
    if not waiting:
        return []
    splitting = piece_rows > 0 and (busy or any(not split and rows for _, rows, split in waiting))
    firsts: dict[str, int] = {}
    remaining: dict[str, int] = {}
    for i, (job_id, rows, _) in enumerate(waiting):
        firsts.setdefault(job_id, i)
        remaining[job_id] = remaining.get(job_id, 0) + rows
    order_of = prefill_rank(waiting, remaining, passed or {}, order, max_passes)
    chunks = iter(sorted((i for i in firsts.values() if waiting[i][2]), key=order_of))
    left, prefill_left = token_budget, piece_rows if splitting else math.inf
    taken: list[tuple[int, int]] = []
    for place in firsts.values():
        i = next(chunks) if waiting[place][2] else place
        rows, split = waiting[i][1], waiting[i][2]
        if split and splitting:
            n = min(rows, prefill_left) if not taken else min(rows, prefill_left, left)
            prefill_left -= n
        else:
            n = rows if not taken or rows <= left else -1
        if n < 0 or (n == 0 and rows > 0):
            continue
        taken.append((i, n))
        left -= n
    return sorted(taken)


def prefill_rank(waiting: Sequence[tuple[str, int, bool]], remaining: Mapping[str, int], passed: Mapping[str, int],
                 order: str, max_passes: int):
    """The sort key of a waiting chunk (by index) in prefill order: aged chunks (passed over
    `max_passes` times or more) first, oldest first; then the shortest remaining prompt,
    ties oldest first. "arrival": oldest first."""
    if order not in PREFILL_ORDERS:
        raise ValueError(f"prefill order must be one of {', '.join(PREFILL_ORDERS)}, got {order!r}")
    if order == "arrival":
        return lambda i: (0, 0, i)

    def key(i: int) -> tuple[int, int, int]:
        job_id = waiting[i][0]
        return (0, 0, i) if passed.get(job_id, 0) >= max_passes else (1, remaining[job_id], i)
    return key


def passed_over(waiting: Sequence[tuple[str, int, bool]], picked: Sequence[tuple[int, int]],
                passed: Mapping[str, int]) -> dict[str, int]:
    """The pass counts after a forward ran `picked` of `waiting`: a job whose first waiting
    frame is a chunk with rows and got none counts one more; a job that got rows starts
    again from 0 (absent), and so does one whose first frame is no chunk."""
    got = {waiting[i][0] for i, n in picked if n > 0}
    out: dict[str, int] = {}
    for job_id, rows, split in waiting:
        if job_id in out or job_id in got:
            continue
        out[job_id] = passed.get(job_id, 0) + 1 if split and rows > 0 else 0
    return {job: n for job, n in out.items() if n}
