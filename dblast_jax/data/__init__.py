"""Data: pinned prompt sets, templates, train/eval disjointness, corpus regeneration,
the on-disk corpus format, corpus statistics, training records and sources
(`records`) and the grain input pipeline the trainer reads (`pipeline`).

Submodules are imported on use (regeneration pulls in JAX models; sources do not).
"""
