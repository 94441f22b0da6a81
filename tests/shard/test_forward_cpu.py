"""ForwardCpu: a stage's forwards' rows and CPU-s by phase, and the process's CPU beside them.

Bugs guarded: a batch's CPU charged whole to each of its frames (or to one), a piece counted
as its whole frame, the line never logged or its counts never reset (issue 21: where a
stage's rows and CPU go). Sound: a hand-stepped clock and process CPU; frames stand in as
objects with a phase and positions.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from shard.forward_cpu import ForwardCpu


def fwd(phase: str, rows: int) -> tuple[SimpleNamespace, bytes]:
    return SimpleNamespace(phase=phase, positions=torch.arange(rows)), b""


def test_a_batchs_cpu_is_shared_by_its_rows_and_the_line_is_logged_then_reset(caplog):
    now, process = [100.0], [5.0]
    cpu = ForwardCpu(every_s=10.0, clock=lambda: now[0], process_cpu=lambda: process[0])
    cpu.add([fwd("decode", 1), fwd("prefill", 3)], [None, None], 0.4)  # 0.1 s a row
    cpu.add([fwd("prefill", 256)], [(0, 64)], 0.64)  # a piece: its 64 rows
    assert cpu.rows == {"decode": 1, "prefill": 67}
    assert abs(cpu.cpu_s["decode"] - 0.1) < 1e-9 and abs(cpu.cpu_s["prefill"] - 0.94) < 1e-9
    now[0], process[0] = 110.0, 7.0
    with caplog.at_level(logging.INFO, logger="shard.node"):
        cpu.add([fwd("verify", 2)], [None], 0.06)
    assert ["stage CPU: 10 s: forwards 1.10 CPU-s (decode 1 rows 0.10 s, prefill 67 rows 0.94 s, verify 2 rows 0.06 s); "
            "process 2.00 CPU-s, 0.90 outside forwards"] == [r.getMessage() for r in caplog.records]
    assert cpu.rows == {} and cpu.since == 110.0 and cpu.process_since == 7.0
