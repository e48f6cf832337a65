"""Throughput predictors: P1 (estimator from layer features), P2 (refiner from observations).

Pure core: numpy, polars and torch only; no workflow, tracking or device adapter.
"""
