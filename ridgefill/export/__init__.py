"""Export: int8 quantization of the maps, the `ridgefill-maps/1` release folder (manifest, tensors, model card)."""
