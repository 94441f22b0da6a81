"""The swarm: registered nodes, their measured links, ring formation and roles.

Decides with ring/ (pure), then signs and sends assignments; runs no requests.
Imports: coordinator.errors.
"""
