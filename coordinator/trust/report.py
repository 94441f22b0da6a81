"""What the trust wing has found, as JSON for the operator (the status page, /metrics):
whether receipts are checked, who recomputes audited slices (verifier-role nodes, then
other members keeping the slice, and this gateway only as a fallback when it holds the
layers), the auditor's counts, the newest evidence (audits' and probation's catches) and
the nodes audits excluded from rings.

Pure: the checker and the auditor in, a dict out. It decides nothing and changes nothing.
"""

from __future__ import annotations

from typing import Any

from coordinator.trust.audit import Auditor
from coordinator.trust.receipt_check import ReceiptChecker
from shard.identity import peer_id_from_public_key
from shard.layers import LayerRange

RECENT_EVIDENCE = 10  # of each kind: audits' and probation's


def recomputed_by(auditor: Auditor) -> str:
    """Who recomputes audited slices, in a sentence for the operator."""
    here = auditor.config.replay_here and auditor.holds(LayerRange(0, auditor.store.num_layers))
    nodes = "verifier-role nodes, else any other member keeping the slice (a stage audits another stage)"
    return (f"verifier nodes: {nodes}; this gateway recomputes a slice itself only when none can (it holds the layers)"
            if here else f"verifier nodes only: {nodes} (this gateway holds no layers or does not recompute); an "
                         "audit none can answer is skipped")


def trust_report(checker: ReceiptChecker | None, auditor: Auditor | None) -> dict[str, Any]:
    """{"receipts": {...}, "audits": {...} or None, "faulty": {peer: reason}}."""
    receipts = {"enabled": checker is not None,
                "receipts_dir": str(checker.config.receipts_dir) if checker is not None and checker.config.receipts_dir else None}
    if auditor is None:
        return {"receipts": receipts, "audits": None, "faulty": {}}
    s = auditor.stats
    evidence = []
    caught = {"audit": auditor.evidence, "probation": checker.evidence if checker is not None else []}
    for found_by, record in [(k, r) for k, records in caught.items() for r in records[-RECENT_EVIDENCE:][::-1]]:
        r, check = record.receipt, record.check
        evidence.append({"peer_id": peer_id_from_public_key(r.signer), "job_id": r.job_id, "round": r.round,
                         "layers": [r.layer_start, r.layer_end], "outliers": check.num_outliers,
                         "elements": check.num_elements, "max_abs_error": check.max_abs_error, "found_by": found_by})
    audits = {"rate": auditor.config.rate, "recomputed_by": recomputed_by(auditor), "audits": s.audits,
              "frames_compared": s.frames_compared, "replay_s": s.replay_s, "by_verifiers": s.by_verifiers,
              "by_members": s.by_members, "by_coordinator": s.by_coordinator, "second_opinions": s.second_opinions,
              "unsettled": s.unsettled, "lying_verifiers": s.lying_verifiers, "disputed": s.disputed,
              "skipped_stale": s.skipped_stale,
              "skipped_gone": s.skipped_gone, "skipped_no_verifier": s.skipped_no_verifier,
              "skipped_no_prefix": s.skipped_no_prefix,
              "evidence": sum(map(len, caught.values())), "recent_evidence": evidence}
    return {"receipts": receipts, "audits": audits, "faulty": dict(auditor.swarm.faulty)}
