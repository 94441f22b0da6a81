"""The gateway: OpenAI-compatible HTTP over an Engine (request schema, routes, errors).

The top floor: it imports the jobs wing, never the other way.
Imports: coordinator.errors, coordinator.jobs, coordinator.spec.
"""
