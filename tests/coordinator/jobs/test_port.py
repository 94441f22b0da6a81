"""The engine's port (ring_engine.EnginePort) offers every verb a job may ask (port.JobPort).

Bug guarded: a verb added to JobPort (or renamed) but not to EnginePort fails only on a
real ring, mid-request, since the job's unit tests run against fake ports. Sound: every
public member JobPort declares is compared, with its kind (property, coroutine, plain).
"""

from __future__ import annotations

import inspect

from coordinator.jobs.port import JobPort
from coordinator.jobs.engine_port import EnginePort


def kind(owner: type, name: str) -> str:
    member = inspect.getattr_static(owner, name)
    if isinstance(member, property):
        return "property"
    return "coroutine" if inspect.iscoroutinefunction(member) else "function"


def parameters(owner: type, name: str) -> list[str]:
    member = inspect.getattr_static(owner, name)
    return list(inspect.signature(member.fget if isinstance(member, property) else member).parameters)


def test_the_engine_port_offers_every_verb_of_the_job_port():
    verbs = [name for name in vars(JobPort) if not name.startswith("_")]
    assert {"send_body", "wait_ring", "wait_change", "ring", "record_traversal", "hand_back", "close"} <= set(verbs)
    for name in verbs:
        assert hasattr(EnginePort, name), name
        assert kind(EnginePort, name) == kind(JobPort, name), name
        assert parameters(EnginePort, name) == parameters(JobPort, name), name
