"""Evaluation: the reference fill runtime (`runtime.prefill` with the exact / ridgefill / identity / nofill arms)
and, later, the release-gate metrics built on it.

Importing this package does not import torch; `ridgefill.evaluate.runtime` does.
"""
