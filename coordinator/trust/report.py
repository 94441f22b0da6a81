"""What the trust wing has found, as JSON for the operator (the status page, /metrics):
whether receipts are checked, the auditor's counts, its newest evidence and the nodes
audits excluded from rings.

Pure: the checker and the auditor in, a dict out. It decides nothing and changes nothing.
"""

from __future__ import annotations

from typing import Any

from coordinator.trust.audit import Auditor
from coordinator.trust.receipt_check import ReceiptChecker
from shard.identity import peer_id_from_public_key

RECENT_EVIDENCE = 10


def trust_report(checker: ReceiptChecker | None, auditor: Auditor | None) -> dict[str, Any]:
    """{"receipts": {...}, "audits": {...} or None, "faulty": {peer: reason}}."""
    receipts = {"enabled": checker is not None,
                "receipts_dir": str(checker.config.receipts_dir) if checker is not None and checker.config.receipts_dir else None}
    if auditor is None:
        return {"receipts": receipts, "audits": None, "faulty": {}}
    s = auditor.stats
    evidence = []
    for record in auditor.evidence[-RECENT_EVIDENCE:][::-1]:
        r, check = record.receipt, record.check
        evidence.append({"peer_id": peer_id_from_public_key(r.signer), "job_id": r.job_id, "round": r.round,
                         "layers": [r.layer_start, r.layer_end], "outliers": check.num_outliers,
                         "elements": check.num_elements, "max_abs_error": check.max_abs_error})
    audits = {"rate": auditor.config.rate, "audits": s.audits, "frames_compared": s.frames_compared,
              "replay_s": s.replay_s, "skipped_stale": s.skipped_stale, "skipped_gone": s.skipped_gone,
              "evidence": len(auditor.evidence), "recent_evidence": evidence}
    return {"receipts": receipts, "audits": audits, "faulty": dict(auditor.swarm.faulty)}
