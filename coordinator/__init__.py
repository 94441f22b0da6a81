"""The gateway: registry, assignment, scheduler, drafters, speculative decoding, HTTP API.

Nothing imports this package.
"""
