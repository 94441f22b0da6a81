"""Jobs: the Engine interface the gateway talks to, and the engines that run jobs.

A ring job brings the ring's K/V up to its committed tokens and verifies drafts round by
round; the local engine runs the whole model in-process. No HTTP here.
Imports: coordinator.errors, coordinator.spec, coordinator.swarm, coordinator.trust.
"""
