"""Serving engines (docs/engines.md): what ridgefill hands them (prepare.py, make.py, which run with ridgefill) and
what runs inside them (layout, request, jobs, the vLLM connector and fill model, llama.cpp injection, the runners).

The engine-side modules import only the standard library, numpy, safetensors, torch, the engine and ridgefill's
numpy-only layers (formats, the store's file hashing), so that they load inside an engine's own environment, where
ridgefill's other requirements (a newer transformers, typer, ...) are absent (tests/test_engines_layout.py).
"""
