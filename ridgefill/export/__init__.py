"""Export: the `ridgefill-maps/1` release folder (manifest, tensors, model card) from a quantize or solve artifact,
or the maps as one GGUF file; the formats themselves are ridgefill.formats'.

    from ridgefill.export import export, export_gguf         # the stage (build.py, gguf.py)
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {"export": "build", "export_gguf": "gguf"})
