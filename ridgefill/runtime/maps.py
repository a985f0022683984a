"""Maps for the fill runtime: a release folder, verified, as {layer: (W, b)} on the model's devices.

    from ridgefill.runtime import load_release_maps
    rel = load_release_maps(lm, "release/smollm2-135m")   # verified; refuses maps made for another model
    rel.maps    # {layer: (W float32 [d, d], b float32 [d])} on each late layer's device
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

from dataclasses import dataclass
from pathlib import Path

import torch

from ridgefill.errors import BadInput
from ridgefill.formats.release.names import (KSCALE_CONFIGURATION, PLAIN, PROTECTED_CONFIGURATION,
                                             ROWS_CONFIGURATION)
from ridgefill.runtime.rows import ANCHOR_ROWS, ROW_SHARE, fit_rows


@dataclass(frozen=True)
class ReleaseMaps:
    """A verified release, ready for `prefill(lm, ids, rel.arm, **rel.options())`."""

    maps: dict  # {layer: (W float32 [d, d], b float32 [d])} for layers split..L-1, on each layer's device
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
        opts = {"split": self.split, "tail": self.tail, "maps": self.maps, "anchor": self.anchor,
                "exact_norm": self.exact_norm}
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


def load_release_maps(lm, folder) -> ReleaseMaps:
    """Verify and load the release in `folder` for the loaded model `lm` (a `ridgefill.models.LoadedModel`).

    BadInput (one line) when the folder does not verify (a configuration the format refuses included), when it was
    made for another model (the manifest's model fingerprint differs from `lm.ref.fingerprint`), or when its maps
    do not cover the late layers split..L-1 with d x d weights, when its terminal-state offsets do not match the
    model's layers, or when its configuration's correction has no layers above the split on this model."""
    from ridgefill.formats.release import MANIFEST, read_release
    from ridgefill.runtime.corrections import check_corrections, check_state_offsets

    folder = Path(folder)
    rel = read_release(folder)
    manifest, maps = rel.manifest, rel.maps
    ref, ad = lm.ref, lm.adapter
    theirs = (manifest.get("model") or {}).get("fingerprint")
    if theirs != ref.fingerprint:
        raise BadInput(f"{folder}: the maps were made for another model (fingerprint {str(theirs)[:12]}) than "
                       f"'{ref.spec}' ({ref.fingerprint[:12]})")  # fmt: skip
    split, tail = manifest.get("split"), manifest.get("tail_default")
    L, d = ad.num_layers, ad.hidden_size
    for key, v, top in (("split", split, L), ("tail_default", tail, None)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "split" else 1) or (top and v > top):
            raise BadInput(f"{folder / MANIFEST}: '{key}' is {v!r}, not a valid value for a {L}-layer model")
    missing = [l for l in range(split, L) if l not in maps]
    if missing:
        raise BadInput(f"{folder}: the release has no maps for late layers {missing} (split {split}, {L} layers)")
    for l in range(split, L):
        w, b = maps[l]["weight"], maps[l]["bias"]
        if w.shape != (d, d) or b.shape != (d,):
            raise BadInput(f"{folder}: layer {l} map is {tuple(w.shape)}, expected ({d}, {d}) for this model")
    late = {l: (maps[l]["weight"], maps[l]["bias"]) for l in range(split, L)}
    offsets = rel.state_offsets
    if offsets is not None:
        try:
            check_state_offsets(ad, split, offsets)
        except BadInput as e:
            raise BadInput(f"{folder}: {e}") from None
        offsets = {l: torch.as_tensor(o).to(ad.layer_device(l)) for l, o in offsets.items()}
    fit = manifest.get("fit") or {}
    rows = fit_rows(fit.get("skip_first_rows", ANCHOR_ROWS), fit.get("exact_norm"), str(folder / MANIFEST))
    conf = rel.configuration
    if conf["arm"] == KSCALE_CONFIGURATION:
        try:
            check_corrections(ad, split, ("kscale",))
        except BadInput as e:
            raise BadInput(f"{folder}: configuration {KSCALE_CONFIGURATION}: {e}") from None
    table = None if rel.protected is None else torch.as_tensor(rel.protected.astype("int64"))
    return ReleaseMaps(maps_on_devices(lm, late, range(split, L)), split, tail, manifest, folder, offsets, **rows,
                       configuration=conf["arm"], row_share=conf.get("row_share", ROW_SHARE), protected=table,
                       sweep=conf["sweep"])
