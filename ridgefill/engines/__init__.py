"""Connectors that let stock serving engines load ridgefill's caches.

Every module here imports only the standard library, numpy, safetensors and torch, so that it loads inside an
engine's own environment, where ridgefill's other requirements (a newer transformers, typer, ...) are absent.
"""
