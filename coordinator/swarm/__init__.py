"""The swarm: registered nodes, their measured links, ring formation and roles.

Formation decides in pure code (formation, on ring/); the Swarm signs and sends what it
decided, waits for Ready and reports on channels it is given; status shows it all as JSON.
Runs no requests.
Imports: coordinator.errors.
"""
