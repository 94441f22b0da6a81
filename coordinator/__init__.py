"""The coordinator: the gateway that runs requests on a ring of volunteer stages.

Its wings, bottom floor first (each imports only the wings its docstring names, and a
meta test holds them to it):

- `coordinator.spec`: speculation core, pure: drafts, acceptance, sampling, the planner.
- `coordinator.swarm`: the registry of nodes, ring formation and roles, topology inputs.
- `coordinator.trust`: receipt checks of every round, audits of stages by replay.
- `coordinator.jobs`: the Engine interface and the engines that run jobs (on a ring, or local).
- `coordinator.gateway`: the OpenAI-compatible HTTP layer over an Engine.

Top-level modules assemble the process: `config` (the component configs composed),
`assembly` (open_coordinator), `server` (HTTP and local nodes on top), `cli`. Nothing
outside imports this package.
"""
