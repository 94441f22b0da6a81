"""Closed-loop HTTP clients for the load benchmarks (bench_load, bench_rings): C clients each
sending its next streamed /v1/completions request when the last ends, what they measure
(tokens in a window, TTFT, inter-token gaps, errors, outputs against references), and
each request served alone for those references. Talks only to the gateway it is given.
"""

from __future__ import annotations

import json
import math
import os
import time

import httpx
import trio

# Seconds after a prompt started that still count as its prefill's (quiet_rate).
QUIET_AFTER_S = 4


async def stream_one(client: httpx.AsyncClient, body: dict, on_chunk) -> str:
    """The text of one streamed completion; `on_chunk(ttft_s, gap_s)` at each content chunk
    (ttft_s on the first, gap_s on the others, the other None). Raises on any failure."""
    t0 = time.monotonic()
    last, text = None, []
    async with client.stream("POST", "/v1/completions", json={"model": "smollm2-135m", "stream": True, **body}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            piece = event["choices"][0]["text"] if event.get("choices") else ""
            if not piece:
                continue
            now = time.monotonic()
            on_chunk(now - t0 if last is None else None, None if last is None else now - last)
            last = now
            text.append(piece)
    return "".join(text)


def kind_of(client: int, k: int, kinds: int) -> int:
    """The mix's kind a client sends as its k-th request: each client walks the whole mix
    in order from its own offset, so at any concurrency every kind is asked equally often,
    as by one client. (Before: `(client + k * clients) % kinds` pinned each client to one
    kind when the concurrency was a multiple of the mix's size: at 16 streams over 8 kinds,
    the two clients of each 1.9k-token prompt sent nothing else, and quick kinds came round
    more often than at one stream.)"""
    return (client + k) % kinds


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


async def closed_loop(base: str, mix: list[dict], clients: int, window_s: float, refs: list[str] | None,
                      ramp_s: float = 0.0, at_ramp_end=None, ramp_until_first: bool = False,
                      ramp_max_s: float = 600.0) -> dict:
    """C clients, each sending its next request when the last ends, for a ramp and then
    window_s seconds; what is measured (tokens, TTFT and ITL of chunks received, requests
    and prompt tokens started) is the window after the ramp: the clients all start at
    once, so the ramp holds every client's first prompt at the same time, which a steady
    load does not. The ramp lasts ramp_s, or with `ramp_until_first` until every client's
    first request has ended too (at most ramp_max_s): at 16 streams a 2k-token request
    lives longer than a 30 s ramp, and a window opened before those first requests end
    measures their prompts' prefill, not the steady mix. The ramp's own tokens are
    reported beside it (`ramp_tok_per_s`, `ramp_s_taken`). `at_ramp_end()` runs when the
    window opens (the CPU reading). Requests still running at the end are cut off (their
    tokens so far count, their TTFT and ITL too; they are not `requests_done` and not
    compared, and every request that finished, ramp or window, is compared)."""
    chunks, ttfts, gaps, errors, done, mismatches, started = [0], [], [], [], [0], [], [0]
    ramp_chunks, prompt_started, firsts_done = [0], [0], [0]
    per_s_tokens, per_s_prompt = [0] * math.ceil(window_s), [0] * math.ceil(window_s)  # the window's timeline
    t0 = time.monotonic()
    opens, deadline, opened_at = [math.inf], [math.inf], [None]

    by_kind: dict[int, list[float]] = {}  # the window's inter-token gaps per kind of the mix

    def on_chunk(ttft, gap, kind=None):
        now = time.monotonic()
        if now < opens[0]:
            ramp_chunks[0] += 1
            return
        if now < deadline[0]:
            chunks[0] += 1
            per_s_tokens[min(int(now - opens[0]), len(per_s_tokens) - 1)] += 1
        if ttft is not None:
            ttfts.append(ttft)
        if gap is not None:
            gaps.append(gap)
            by_kind.setdefault(kind, []).append(gap)

    async def client_loop(i: int, client: httpx.AsyncClient):
        k = 0
        while time.monotonic() < deadline[0]:
            kind = kind_of(i, k, len(mix))
            k += 1
            if (now := time.monotonic()) >= opens[0]:
                started[0] += 1
                prompt_started[0] += len(mix[kind]["prompt"])
                if now < deadline[0]:
                    per_s_prompt[min(int(now - opens[0]), len(per_s_prompt) - 1)] += len(mix[kind]["prompt"])
            try:
                text = await stream_one(client, mix[kind], lambda ttft, gap, kind=kind: on_chunk(ttft, gap, kind))
            except Exception as exc:  # noqa: BLE001 - every failure is a counted error
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            finally:
                firsts_done[0] += k == 1
            done[0] += 1
            if refs is not None and text != refs[kind]:
                mismatches.append(kind)

    async def open_window(scope: trio.CancelScope):
        while True:
            now = time.monotonic()
            ramped = now - t0 >= ramp_s and (not ramp_until_first or firsts_done[0] >= clients)
            if ramped or now - t0 >= ramp_max_s:
                break
            await trio.sleep(0.05)
        opens[0], deadline[0] = now, now + window_s
        opened_at[0] = time.time()
        scope.deadline = trio.current_time() + window_s  # requests in flight then are cut off
        if at_ramp_end is not None:
            at_ramp_end()

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                for i in range(clients):
                    nursery.start_soon(client_loop, i, client)
                nursery.start_soon(open_window, scope)
        elapsed = time.monotonic() - t0
    ramp_taken = opens[0] - t0
    return {"clients": clients, "ramp_s": ramp_s, "ramp_until_first": ramp_until_first,
            "ramp_s_taken": round(ramp_taken, 1), "window_opened_unix_s": opened_at[0],
            "window_s": window_s, "wall_s": elapsed, "tokens": chunks[0],
            "tok_per_s": chunks[0] / window_s, "ramp_tok_per_s": ramp_chunks[0] / ramp_taken if ramp_taken else None,
            "requests_started": started[0], "prompt_tokens_started": prompt_started[0], "requests_done": done[0],
            "ttfts_measured": len(ttfts), "errors": len(errors),
            "error_samples": errors[:3], "outputs_equal_alone": None if refs is None else not mismatches,
            "mismatched_kinds": sorted(set(mismatches)), "ttft_p50_s": pct(ttfts, 0.5), "ttft_p95_s": pct(ttfts, 0.95),
            "itl_p50_s": pct(gaps, 0.5), "itl_p95_s": pct(gaps, 0.95), "load_average": list(os.getloadavg()),
            "itl_p95_s_by_kind": {k: pct(v, 0.95) for k, v in sorted(by_kind.items())},
            "timeline": {"tokens_per_s": per_s_tokens, "prompt_tokens_started_per_s": per_s_prompt},
            "quiet_tok_per_s": quiet_rate(per_s_tokens, per_s_prompt)}


def quiet_rate(tokens: list[int], prompts: list[int], after_s: int = QUIET_AFTER_S) -> float | None:
    """Tokens per second over the window's seconds in which no prompt started, nor in the
    `after_s` seconds before (a prompt's prefill displaces decoding for a few seconds: at 16
    streams on the dev VM's loopback ring the rate fell from ~100 to 15-40 tok/s for 3-5 s
    after the clients' prompts arrived together): the steady decode rate between them; None
    when no such second."""
    quiet = [n for i, n in enumerate(tokens) if not any(prompts[max(0, i - after_s):i + 1])]
    return sum(quiet) / len(quiet) if quiet else None


async def alone(base: str, mix: list[dict]) -> list[str]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return [await stream_one(client, body, lambda ttft, gap: None) for body in mix]
