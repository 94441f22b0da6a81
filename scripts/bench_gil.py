"""What a busy trio thread costs a worker thread's torch work, by GIL switch interval (issue 21).

The gateway's worker thread runs each LM-head product and its rows' sampling
(coordinator.jobs.head_batch) while the trio thread checks receipts, decodes Results and
sends frames; a node's worker runs forwards beside its own trio thread. Here one thread
runs a product of SmolLM2's head shape (49152 x 576 f32, seeded random weights scaled so
the logits' spread, std ~4, leaves a top-p nucleus of tens to hundreds of tokens as a
trained head's do; with flat logits every row would fall back to a full sort) for 8 rows and samples each row with the gateway's own
`coordinator.spec.sampling.sample` (temperature 0.8, top-p 0.95), `--products` times,
alone and then beside a second thread running pure Python without pause (what the trio
thread does while a burst of frames is in), at each switch interval in `--intervals`
(CPython's default 0.005 s first), the intervals taken in turn `--reps` times, best wall
time kept. One torch thread. The product thread's own CPU time is reported too: the
difference is time spent waiting for the GIL.

    python scripts/bench_gil.py --json OUT [--intervals 0.005,0.001,0.0005] [--reps 3] [--products 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from coordinator.spec.sampling import SamplingParams, sample  # noqa: E402
from scripts.bench_ringkit import git_revision  # noqa: E402

ROWS, VOCAB, HIDDEN = 8, 49152, 576


def products(weight: torch.Tensor, hidden: torch.Tensor, n: int, params: SamplingParams) -> tuple[float, float]:
    """n products and their rows' samples: (wall s, this thread's CPU s)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for i in range(n):
        logits = hidden @ weight.T
        for r in range(ROWS):
            sample(logits[r], params, seed=i, position=r)
    return time.perf_counter() - wall, time.thread_time() - cpu


def beside_busy(fn) -> tuple[float, float]:
    """fn() while another thread runs Python without pause."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(i * i for i in range(2000))
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        return fn()
    finally:
        stop.set()
        spinner.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--intervals", default="0.005,0.001,0.0005", help="switch intervals to compare (s)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--products", type=int, default=40)
    args = ap.parse_args(argv)
    intervals = [float(x) for x in args.intervals.split(",")]
    if any(not 0 < s <= 1 for s in intervals) or args.reps < 1 or args.products < 1:
        ap.error("intervals must be in (0, 1] s, reps and products at least 1")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * (4.0 / HIDDEN ** 0.5)  # logits' std ~4
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    run = lambda: products(weight, hidden, args.products, params)  # noqa: E731
    best: dict[float, dict[str, tuple[float, float]]] = {}
    before = sys.getswitchinterval()
    try:
        for _ in range(args.reps):
            for s in intervals:
                sys.setswitchinterval(s)
                got = {"alone": run(), "beside_busy_python": beside_busy(run)}
                mine = best.setdefault(s, got)
                for k, v in got.items():
                    if v[0] < mine[k][0]:
                        mine[k] = v
    finally:
        sys.setswitchinterval(before)
    rows = []
    for s in intervals:
        (aw, ac), (bw, bc) = best[s]["alone"], best[s]["beside_busy_python"]
        rows.append({"switch_interval_s": s, "alone_wall_s": round(aw, 4), "alone_cpu_s": round(ac, 4),
                     "beside_busy_wall_s": round(bw, 4), "beside_busy_cpu_s": round(bc, 4),
                     "slowdown_beside_busy": round(bw / aw, 2)})
        print(f"switch {1e3 * s:5.2f} ms: alone {aw:.3f} s wall ({ac:.3f} CPU), beside busy Python "
              f"{bw:.3f} s wall ({bc:.3f} CPU): {bw / aw:.2f}x", flush=True)
    result = {"conditions": {
        "work": f"{args.products} products of {ROWS} rows x ({VOCAB} x {HIDDEN}) f32 (logits' std ~4), each row "
                "sampled (coordinator.spec.sampling.sample, temperature 0.8, top-p 0.95)",
        "busy": "a second thread running pure Python without pause", "reps": args.reps,
        "timing": "best wall of reps, the intervals taken in turn", "torch_threads": 1,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()), "git_revision": git_revision()}, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
