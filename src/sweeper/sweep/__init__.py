"""Sweep stages: the search-space DSL and the Ray Tune searchers/schedulers built from it."""
