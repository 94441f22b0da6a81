"""The data-only wire: dtype table, fp8 codec, typed messages and the frame codec.

Knows nothing of streams or peers' identities (shard/transport.py) or of what a stage
does with a frame. See docs/protocol.md for the byte layout.
"""
