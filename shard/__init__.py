"""One node: model store, a stage's forward over its layers, KV cache, wire, transport.

Does not know how rings are chosen (ring/) or how requests are scheduled (coordinator/).
Importing this package is cheap: torch is imported only by the modules that compute.
"""
