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
manifest's hashes before anything is used; the split, the default tail, the configuration and the model's identity
come from the manifest it returns.

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ridgefill.errors import BadInput
from ridgefill.formats.release.names import (KSCALE_CONFIGURATION, PLAIN, PROTECTED_CONFIGURATION,
                                             ROWS_CONFIGURATION)
from ridgefill.runtime.rows import ANCHOR_ROWS, ROW_SHARE


@dataclass(frozen=True)
class ReleaseMaps:
    """A verified release, ready for `prefill(lm, ids, rel.arm, **rel.options())`."""

    maps: dict  # {layer: (W float32 [d_out, d], b float32 [d_out])} for layers split..L-1, on each layer's device
    split: int  # the first layer the fill skips for prefix rows
    tail: int  # the release's default tail (`tail_default`): prompt rows that run every layer
    manifest: dict  # the verified `ridgefill.json`
    folder: Path
    state_offsets: dict | None = None  # {layer: float32 tensor} for prefill(corrections=("state",)), or None
    anchor: int = ANCHOR_ROWS  # leading rows the fit left out (`fit.skip_first_rows`): run exactly
    exact_norm: float | None = None  # `fit.exact_norm`: prefix rows whose split-state norm exceeds it run exactly
    configuration: str = PLAIN  # the release's `configuration.arm` (formats.release.CONFIGURATIONS)
    row_share: float = ROW_SHARE  # `configuration.row_share` of a ridgefill+rows release
    protected: torch.Tensor | None = None  # the protected-token table (int64 token ids, ascending), or None
    sweep: str | None = None  # `configuration.sweep`: the sweep that recommended the configuration, or None
    map_kinds: dict = field(default_factory=dict)  # {layer: "input" | "kv"}: what each map predicts (`layers[].map`)

    @property
    def arm(self) -> str:
        """The runtime arm that applies the release as made: "ridgefill+rows" for that configuration, else
        "ridgefill" (the other configurations are options of it)."""
        return ROWS_CONFIGURATION if self.configuration == ROWS_CONFIGURATION else PLAIN

    def options(self) -> dict:
        """The fill options the release prescribes: `prefill(lm, ids, rel.arm, **rel.options())` fills with its
        split, default tail and maps, runs exactly the first `anchor` rows (which its fit left out) and the prefix
        rows whose split state's norm exceeds `exact_norm` (later sinks), and applies its configuration:
        `row_share` for ridgefill+rows, `corrections=("kscale",)` for ridgefill+kscale, `protected` (the table) for
        ridgefill+protected. Any of them may be overridden:
        `prefill(..., **rel.options(), tail=256)` is an error, `prefill(..., **{**rel.options(), "tail": 256})` is
        not."""
        opts = {"split": self.split, "tail": self.tail, "maps": self.maps, "map_kinds": self.map_kinds,
                "anchor": self.anchor, "exact_norm": self.exact_norm}
        if self.configuration == ROWS_CONFIGURATION:
            opts["row_share"] = self.row_share
        elif self.configuration == KSCALE_CONFIGURATION:
            opts["corrections"] = ("kscale",)
        elif self.configuration == PROTECTED_CONFIGURATION:
            opts["protected"] = self.protected
        return opts


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
    `lm`'s, or a protected-token table past its vocabulary: `Release.check_model`), when its terminal-state offsets
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
                    where=str(folder))
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
    table = None if rel.protected is None else torch.as_tensor(rel.protected.astype("int64"))
    return ReleaseMaps(maps_on_devices(lm, late, range(split, L)), split, rel.tail, rel.manifest, folder, offsets,
                       anchor=rel.anchor, exact_norm=rel.exact_norm, configuration=conf["arm"],
                       row_share=conf.get("row_share", ROW_SHARE), protected=table, sweep=conf["sweep"],
                       map_kinds=dict(rel.map_kinds))
