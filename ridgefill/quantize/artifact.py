"""The quantize artifact (docs/store.md): file names and readers; later stages read it only through this module.

    quant.safetensors   the int8 maps in the release tensor layout (`layer.<l>.codes` int8, `layer.<l>.scales` bf16,
                        `layer.<l>.bias` bf16); metadata {group_size}
    report.json         the largest error per layer and the held-out score before and after

`float_maps` reads the maps of a solve or a quantize artifact alike, as eval and the GGUF export take them.
"""

from __future__ import annotations

import numpy as np

from ridgefill.artifacts import Artifact
from ridgefill.errors import RidgefillError
from ridgefill.formats import int8, safetensors
from ridgefill.formats.release import BIAS, CODES, SCALES, tensor_name
from ridgefill.numerics import bf16_bits_to_f32

QUANT = "quant.safetensors"
REPORT = "report.json"


def group_size(art: Artifact) -> int:
    """The group size a quantize artifact was quantized with. Its recipe's `group_size` and the `group_size`
    metadata of its quant.safetensors must agree where both are present (RidgefillError otherwise)."""
    recorded = safetensors.read_header(art.file(QUANT))[1].get("group_size")
    group = art.recipe.get("group_size", recorded)
    if recorded is not None and str(group) != recorded:
        raise RidgefillError(f"quantize artifact {art.id}: {QUANT} records group size {recorded}, its recipe {group}")
    if isinstance(group, str) and group.isdigit():
        group = int(group)
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise RidgefillError(f"quantize artifact {art.id} records no valid group size ({group!r})")
    return group


def load_quant(art: Artifact) -> dict[int, dict[str, np.ndarray]]:
    """{layer: {"codes", "scale_bits", "bias" (float32)}} as `release.write_release` takes them, with
    `group_size(art)`."""
    arrays, _ = safetensors.load(art.file(QUANT))
    layers = sorted({int(k.split(".")[1]) for k in arrays})
    return {l: {"codes": arrays[tensor_name(l, CODES)],
                "scale_bits": arrays[tensor_name(l, SCALES)].bits,
                "bias": bf16_bits_to_f32(arrays[tensor_name(l, BIAS)].bits)} for l in layers}


def decoded_maps(art: Artifact) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{layer: (W float32 [d_out, d_in], b float32 [d_out])}: the int8 maps decoded with the artifact's group size."""
    group = group_size(art)
    return {l: (int8.dequantize(q["codes"], q["scale_bits"], group), q["bias"]) for l, q in load_quant(art).items()}


def float_maps(art: Artifact) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The maps a solve or quantize artifact holds, as float32 {layer: (W, b)} (int8 decoded)."""
    if art.stage == "quantize":
        return decoded_maps(art)
    from ridgefill.solve.artifact import load_maps

    return load_maps(art)
