"""Evaluation: the release-gate measurements (documents, needles, summary, gate) built on the fill runtime
(`ridgefill.runtime`).

Importing this package does not import torch; `ridgefill.runtime` does.
"""
