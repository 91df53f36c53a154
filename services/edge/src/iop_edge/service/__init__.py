"""The edge's use cases: dispatch over the provider registry, the catalog, batches.

Between ``domain/`` (pure rules) and the rim (``adapters/``, ``entrypoints/``):
these modules hold state and run the flows, and know neither HTTP nor protobuf.
"""
