"""Micro-benchmark: receipt sign/verify cost per receipt and per 4-stage chain.

    python scripts/bench_receipts.py [--json OUT] [--repeats N] [--stages 4] [--num-layers 30]

Prints conditions with the numbers (CPU, Python, cryptography version, git revision) so
they can be set against a stage's forward time (target: receipts <= 2% of stage time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cryptography

from receipts import (
    Assignment,
    NodeKey,
    decode_receipt,
    encode_receipt,
    sha256_digest,
    sign_receipt,
    verify_chain,
)

FRAME_BYTES = 576 * 4 * 8  # a decode round of 8 positions of SmolLM2 hidden states in fp32


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _per_call_us(fn, repeats: int) -> dict[str, float]:
    """Median and p90 of `repeats` timed calls, in microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return {"median_us": statistics.median(times), "p90_us": times[int(0.9 * (len(times) - 1))]}


def run(repeats: int, stages: int, num_layers: int) -> dict[str, object]:
    keys = [NodeKey.from_private_bytes(sha256_digest(b"bench %d" % i)) for i in range(stages)]
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        ranges.append((start, start + base + (i < extra)))
        start = ranges[-1][1]
    manifest, weights, nonce = sha256_digest(b"m"), sha256_digest(b"w"), os.urandom(16)
    frame = os.urandom(FRAME_BYTES)

    def chain() -> tuple[list, bytes, bytes]:
        data = sent = sha256_digest(frame)
        out = []
        for k, (a, b) in zip(keys, ranges):
            nxt = sha256_digest(data, b"x")
            out.append(sign_receipt(k, manifest_digest=manifest, weights_digest=weights, epoch=1, job_id="bench",
                                    round=0, nonce=nonce, layer_start=a, layer_end=b, input_digest=data,
                                    output_digest=nxt))  # fmt: skip
            data = nxt
        return out, sent, data

    receipts, sent, received = chain()
    assignments = {k.public_bytes(): Assignment(a, b, weights) for k, (a, b) in zip(keys, ranges)}
    encoded = [encode_receipt(r) for r in receipts]
    one = receipts[0]
    fields = {n: getattr(one, n) for n in ("manifest_digest", "weights_digest", "epoch", "job_id", "round", "nonce",
                                           "layer_start", "layer_end", "input_digest", "output_digest")}  # fmt: skip

    def verify_all() -> None:
        verify_chain(encoded, manifest_digest=manifest, num_layers=num_layers, epoch=1, job_id="bench", round=0,
                     nonce=nonce, sent_digest=sent, received_digest=received, assignments=assignments)  # fmt: skip

    results = {
        "digest_frame": _per_call_us(lambda: sha256_digest(frame), repeats),
        "sign_receipt": _per_call_us(lambda: sign_receipt(keys[0], **fields), repeats),
        "encode_receipt": _per_call_us(lambda: encode_receipt(one), repeats),
        "decode_receipt": _per_call_us(lambda: decode_receipt(encoded[0]), repeats),
        "verify_signature": _per_call_us(one.signature_ok, repeats),
        f"sign_chain_{stages}_stages": _per_call_us(chain, max(1, repeats // stages)),
        f"verify_chain_{stages}_stages": _per_call_us(verify_all, max(1, repeats // stages)),
    }
    return {
        "conditions": {
            "git_revision": _git_revision(),
            "python": platform.python_version(),
            "cryptography": cryptography.__version__,
            "machine": platform.machine(),
            "processor": platform.processor() or "unknown",
            "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "repeats": repeats,
            "stages": stages,
            "num_layers": num_layers,
            "frame_bytes_digested": FRAME_BYTES,
            "receipt_bytes": len(encoded[0]),
        },
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="also write the results here")
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=30)
    args = p.parse_args(argv)
    report = run(args.repeats, args.stages, args.num_layers)
    for k, v in report["conditions"].items():
        print(f"# {k}: {v}")
    for name, r in report["results"].items():
        print(f"{name:28s} median {r['median_us']:9.1f} us   p90 {r['p90_us']:9.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
