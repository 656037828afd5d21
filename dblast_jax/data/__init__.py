"""Data: prompt sets, training corpora and the input pipeline that feeds the trainer.

Pinned prompt sets (`sources`), templates, train/eval disjointness (`dedup`), corpus
regeneration, the on-disk corpus format, corpus statistics, training records and sources
(`records`) and the grain input pipeline the trainer reads (`pipeline`).

Submodules are imported on use (regeneration pulls in JAX models; sources do not).
"""
