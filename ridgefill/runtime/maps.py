"""Maps for the fill runtime: a release folder, verified, as {layer: (W, b)} on the model's devices.

    from ridgefill.runtime import load_release_maps
    rel = load_release_maps(lm, "release/smollm2-135m")   # verified; refuses maps made for another model
    rel = load_release_maps(lm, "hf://owner/name")        # a Hub release: pulled once into the release cache
    rel.maps    # {layer: (W float32 [d_out, d], b float32 [d_out])} on each late layer's device
    rel.map_kinds   # {layer: "input" (d_out = d) | "kv" (keys before RoPE and QK-norm, then values)}
    rel.split, rel.tail, rel.manifest
    prefill(lm, ids, rel.arm, **rel.options())   # the release as made: its split, tail, maps and configuration
    rel.state_offsets   # a hybrid's terminal-state offsets {layer: [value heads, key dim, value dim]}, or None

The folder is read only through `ridgefill.formats.release.read_release`, which checks every file against the
manifest's hashes before anything is used; every fact (split, tail, configuration, the model's identity) is its
`Release`'s (`rel.release`), and the options are its `fill_options()` with the maps in place, as eval and the vLLM
plugin apply them.

A release's `configuration` (docs/format.md) says how it is applied, and `rel.arm` / `rel.options()` apply it:

    configuration          rel.arm            rel.options() adds
    ridgefill (or none)    "ridgefill"        -
    ridgefill+rows         "ridgefill+rows"   row_share (the release's)
    ridgefill+kscale       "ridgefill"        corrections=("kscale",)
    ridgefill+protected    "ridgefill"        protected (the release's protected-token table: those tokens' rows run
                                              exactly)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ridgefill.errors import BadInput
from ridgefill.formats.release.names import KSCALE_CONFIGURATION
from ridgefill.formats.release.read import Release
from ridgefill.runtime.rows import ROW_SHARE


@dataclass(frozen=True)
class ReleaseMaps:
    """A verified release on a model's devices, ready for `prefill(lm, ids, rel.arm, **rel.options())`: the reader's
    `Release` (every fact, checked once) and its maps where the model's late layers are."""

    release: Release  # formats.release.read_release's, checked against the model by `Release.check_model`
    maps: dict  # {layer: (W float32 [d_out, d], b float32 [d_out])} for layers split..L-1, on each layer's device
    folder: Path
    state_offsets: dict | None = None  # {layer: float32 tensor} for prefill(corrections=("state",)), or None

    split = property(lambda self: self.release.split)  # the first layer the fill skips for prefix rows
    tail = property(lambda self: self.release.tail)  # the release's default tail (`tail_default`)
    anchor = property(lambda self: self.release.anchor)  # leading rows the fit left out: run exactly
    exact_norm = property(lambda self: self.release.exact_norm)  # prefix rows above this split-state norm: exact
    manifest = property(lambda self: self.release.manifest)  # the verified `ridgefill.json`
    map_kinds = property(lambda self: dict(self.release.map_kinds))  # {layer: "input" | "kv"}
    configuration = property(lambda self: self.release.configuration["arm"])  # formats.release.CONFIGURATIONS
    sweep = property(lambda self: self.release.configuration["sweep"])  # the sweep that recommended it, or None
    arm = property(lambda self: self.release.arm)  # the runtime arm that applies the release as made

    @property
    def row_share(self) -> float:
        """`configuration.row_share` of a ridgefill+rows release (the default share otherwise)."""
        return float(self.release.configuration.get("row_share", ROW_SHARE))

    @property
    def protected(self) -> np.ndarray | None:
        """The release's protected-token table (int64 token ids, ascending), or None."""
        return None if self.release.protected is None else self.release.protected.astype(np.int64)

    def options(self) -> dict:
        """The fill options the release prescribes (`Release.fill_options`), with the maps in place: `prefill(lm,
        ids, rel.arm, **rel.options())` fills with its split, default tail and maps, runs exactly the first `anchor`
        rows (which its fit left out) and the prefix rows whose split state's norm exceeds `exact_norm` (later
        sinks), and applies its configuration: `row_share` for ridgefill+rows, `corrections=("kscale",)` for
        ridgefill+kscale, `protected` (the table) for ridgefill+protected. Any of them may be overridden:
        `prefill(..., **rel.options(), tail=256)` is an error, `prefill(..., **{**rel.options(), "tail": 256})` is
        not."""
        return {**self.release.fill_options(), "maps": self.maps}


def maps_on_devices(lm, maps: dict, layers) -> dict:
    """{layer: (W, b)} as float32 tensors on each late layer's device (numpy arrays or tensors anywhere in).

    `prefill` calls it before its clock starts; a caller running many prefills with the same maps can call it
    once (tensors already in place are not copied again)."""
    ad = lm.adapter
    out = dict(maps)
    for l in layers:
        dev = ad.layer_device(l)
        W, b = maps[l]
        out[l] = (torch.as_tensor(W, dtype=torch.float32).to(dev), torch.as_tensor(b, dtype=torch.float32).to(dev))
    return out


def load_release_maps(lm, folder, release=None) -> ReleaseMaps:
    """Verify and load the release in `folder` for the loaded model `lm` (a `ridgefill.models.LoadedModel`); a caller
    that has read it already (`formats.release.read_release(folder)`) passes it as `release`, and it is not read again.
    `folder` is named as everywhere a release is (`hub.releases.locate_release`): a folder, or the string
    `hf://owner/name[@rev]`, pulled and verified into the release cache once and read from there after.

    BadInput (one line) when the folder does not verify (a configuration the format refuses, an impossible split or
    tail included), when it was made for another model (another fingerprint, layer count, width or KV shape than
    `lm`'s, a protected-token table past its vocabulary, or maps that write past the range of the dtype it computes
    in: `Release.check_model`), when its terminal-state offsets
    do not match the model's layers, or when its configuration's correction has no layers above the split on this
    model. Every fact comes from the reader's `Release`, checked there once."""
    from ridgefill.formats.release import read_release
    from ridgefill.hub.releases import locate_release
    from ridgefill.runtime.corrections import check_corrections, check_state_offsets

    if release is None:  # hf://owner/name[@rev] pulled into the release cache; a missing folder refused, never fetched
        folder = locate_release(os.fspath(folder))
        release = read_release(folder)
    folder, rel = Path(folder), release
    ref, ad = lm.ref, lm.adapter
    rel.check_model(fingerprint=ref.fingerprint, num_layers=ad.num_layers, hidden_size=ad.hidden_size,
                    num_kv_heads=ad.num_kv_heads, head_dim=ad.head_dim, vocab_size=ad.vocab_size, name=ref.spec,
                    where=str(folder), dtype=lm.dtype)
    split, L = rel.split, ad.num_layers
    late = {l: (rel.maps[l]["weight"], rel.maps[l]["bias"]) for l in range(split, L)}
    offsets = rel.state_offsets
    if offsets is not None:
        try:
            check_state_offsets(ad, split, offsets)
        except BadInput as e:
            raise BadInput(f"{folder}: {e}") from None
        offsets = {l: torch.as_tensor(o).to(ad.layer_device(l)) for l, o in offsets.items()}
    conf = rel.configuration
    if conf["arm"] == KSCALE_CONFIGURATION:
        try:
            check_corrections(ad, split, ("kscale",))
        except BadInput as e:
            raise BadInput(f"{folder}: configuration {KSCALE_CONFIGURATION}: {e}") from None
    return ReleaseMaps(rel, maps_on_devices(lm, late, range(split, L)), folder, offsets)
