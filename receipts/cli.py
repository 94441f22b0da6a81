"""`shard-receipts`: check job bundles offline.

    shard-receipts verify BUNDLE... [--manifest manifest.json] [--coordinator-key HEX] [--json]

Prints one line per failure (which check, which round and stage, which layers) and an "ok"
line per bundle that verifies; exits 0 only if every bundle verifies, 1 if any does not,
2 for a usage error or an unreadable manifest. The layer count comes from the model
store's manifest.json ("num_layers", "digest" at top level); without --manifest each
bundle's own recorded count is used, with a warning, since that proves less.
This module does not know how bundles are checked; it reads files and prints verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from receipts.bundle import bundle_failures, decode_bundle
from receipts.errors import MalformedError, VerificationError
from receipts.schema import MAX_LAYERS

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Manifest:
    """The two facts verification needs from a model store's manifest.json."""

    num_layers: int
    digest: bytes


@dataclass
class BundleResult:
    path: str
    job_id: str | None = None
    failures: list[dict[str, object]] = field(default_factory=list)


class ManifestError(Exception):
    """The --manifest file cannot supply a layer count and digest (CLI usage error)."""


def read_manifest(path: str) -> Manifest:
    """num_layers and the digest (64 hex chars, optional "sha256:" prefix) from manifest.json."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read manifest {path}: {e}") from e
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest {path}: expected a JSON object")
    n, digest = obj.get("num_layers"), obj.get("digest")
    if type(n) is not int or not 0 < n <= MAX_LAYERS:
        raise ManifestError(f"manifest {path}: num_layers must be a positive int, got {n!r}")
    if not isinstance(digest, str):
        raise ManifestError(f"manifest {path}: digest must be a hex string, got {digest!r}")
    hexdigest = digest.removeprefix("sha256:")
    try:
        raw = bytes.fromhex(hexdigest)
    except ValueError:
        raw = b""
    if len(raw) != 32 or len(hexdigest) != 64:
        raise ManifestError(f"manifest {path}: digest must be 64 hex chars (sha256), got {digest!r}")
    return Manifest(num_layers=n, digest=raw)


def check_bundle_file(path: str, manifest: Manifest | None, coordinator_key: bytes | None) -> BundleResult:
    result = BundleResult(path)
    try:
        bundle = decode_bundle(Path(path).read_bytes())
    except OSError as e:
        result.failures.append(_failure("unreadable", None, None, None, f"cannot read: {e.strerror or e}"))
        return result
    except MalformedError as e:
        result.failures.append(_failure("malformed_bundle", None, None, None, str(e)))
        return result
    result.job_id = bundle.job_id
    errors = bundle_failures(
        bundle,
        num_layers=manifest.num_layers if manifest else bundle.num_layers,
        manifest_digest=manifest.digest if manifest else None,
        coordinator_key=coordinator_key,
    )
    result.failures.extend(_failure(e.check, e.round, e.stage, e.layers, str(e)) for e in errors)
    return result


def _failure(check: str, round: int | None, stage: int | None, layers: tuple[int, int] | None, message: str) -> dict[str, object]:
    return {"check": check, "round": round, "stage": stage, "layers": list(layers) if layers else None, "message": message}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shard-receipts", description="Check shard receipt bundles offline.")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="verify job bundles; exit 0 only if all verify")
    v.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundle JSON files")
    v.add_argument("--manifest", metavar="PATH", help="model store manifest.json (num_layers, digest)")
    v.add_argument("--coordinator-key", metavar="HEX", help="expected coordinator Ed25519 public key (64 hex)")
    v.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings = []
    try:
        manifest = read_manifest(args.manifest) if args.manifest else None
    except ManifestError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    coordinator_key = None
    if args.coordinator_key is not None:
        try:
            coordinator_key = bytes.fromhex(args.coordinator_key)
        except ValueError:
            coordinator_key = b""
        if len(coordinator_key) != 32:
            print("error: --coordinator-key must be 64 hex chars (an Ed25519 public key)", file=sys.stderr)
            return EXIT_USAGE
    if manifest is None:
        warnings.append(
            "no --manifest: using each bundle's own recorded layer count, so coverage is "
            "checked against the bundle's claim, not the model's"
        )
    if coordinator_key is None:
        warnings.append(
            "no --coordinator-key: each bundle's signature was checked against the key the bundle "
            "names, so who signed it was not checked; pass your coordinator's key (it prints it at "
            "start, and serves it at GET /v1/receipts/key)"
        )
    results = [check_bundle_file(path, manifest, coordinator_key) for path in args.bundles]
    all_ok = all(not r.failures for r in results)
    if args.json:
        doc = {
            "ok": all_ok,
            "warnings": warnings,
            "bundles": [{"path": r.path, "job_id": r.job_id, "ok": not r.failures, "failures": r.failures} for r in results],
        }
        print(json.dumps(doc, indent=1))
    else:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        for r in results:
            for f in r.failures:
                print(f"FAIL {r.path}: {f['message']}")
            if not r.failures:
                print(f"ok {r.path}: job {r.job_id}")
    return EXIT_OK if all_ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
