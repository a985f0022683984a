"""ridgefill: make, check and publish RidgeFill map releases.

Importing this package is cheap: torch, transformers, safetensors and huggingface_hub are imported
inside the functions that need them, so `ridgefill --help` starts fast.
"""

__version__ = "0.1.0"
