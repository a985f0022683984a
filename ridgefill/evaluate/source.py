"""What eval and sweep measure: maps with the facts they need about them (`MapsSource`), from a release (a folder,
or a Hub release `hf://owner/name[@rev]`) or a solve / quantize artifact of the store. One loader for both, so a
sweep's split is measured exactly as eval would measure its release. A release's configuration (docs/format.md)
comes with it: the arm it is applied with, which eval measures beside its default arms and gates by default, and the
row share of ridgefill+rows."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ridgefill.artifacts import Store, recipe_id
from ridgefill.errors import BadInput
from ridgefill.runtime.rows import ANCHOR_ROWS, ROW_SHARE, fit_rows


@dataclass(frozen=True)
class MapsSource:
    maps: dict  # {layer: (W float32 [d_out, d], b float32 [d_out])}
    split: int
    fingerprint: str  # the model the maps were fitted on
    ident: str  # content identity for the recipe
    calibration: frozenset  # calibration document sha256s
    release_dir: Path | None
    state_offsets: dict | None = None  # a hybrid's terminal-state offsets {layer: float32 array}
    protected: frozenset | None = None  # the protected-token table: token ids
    anchor: int = ANCHOR_ROWS  # leading rows run exactly: the rows the fit left out (`fit.skip_first_rows`)
    exact_norm: float | None = None  # prefix rows above this split-state norm run exactly (`fit.exact_norm`)
    configuration: str = "ridgefill"  # the arm the release is applied with (`configuration.arm`; artifacts: plain)
    row_share: float = ROW_SHARE  # the share of rows "+rows" runs exactly (a ridgefill+rows release's own)
    map_kinds: dict = field(default_factory=dict)  # {layer: "input" | "kv"}: what each map predicts
    release: object = None  # the reader's `Release` when the maps are a release's (checked against the model by it)
    states: tuple = ()  # (split, l1, ...) when the maps read earlier states too; (): h_S alone

    @property
    def reads(self) -> tuple:
        """The layers whose inputs the maps read: the split, then any earlier ones (what an exact run keeps)."""
        return self.states or (self.split,)


def locate_source(source: str) -> str:
    """What eval names (RELEASE_OR_MAPS) as what the loaders here read: a release named as everywhere a release is
    (`hub.releases.locate_release`: `hf://owner/name[@rev]` pulled into the release cache, its folder returned), a
    path that exists as it is, and a path that does not -- one written with a `/` that is not a store's
    `stage/id` -- refused as a missing folder, never looked up on the Hub nor in the store; anything else is an
    artifact id (or unique prefix) of the store."""
    from ridgefill.artifacts.store import STAGES
    from ridgefill.hub.releases import HUB, locate_release

    path_like = "/" in source.replace(os.sep, "/") and source.partition("/")[0] not in STAGES
    if source.startswith(HUB) or (path_like and not Path(source).expanduser().exists()):
        return str(locate_release(source))
    return source


def configuration_of(source: str) -> str:
    """The configured arm of `source` (a release folder's `configuration.arm`, "ridgefill" for a release without one
    and for a store artifact), read from the manifest alone, before anything is loaded (BadInput for a configuration
    the format refuses); `load_source` verifies the release."""
    from ridgefill.formats import release

    p = Path(locate_source(source))
    if not (p / release.MANIFEST).is_file():
        return release.PLAIN
    return release.release_configuration(release.read_manifest(p))["arm"]


def load_source(store: Store, source: str) -> MapsSource:
    """A release (a folder, or `hf://owner/name[@rev]`: `locate_source`), or a solve / quantize artifact of the
    store."""
    from ridgefill.formats import release

    source = locate_source(source)
    p = Path(source)
    if (p / release.MANIFEST).is_file():
        rel = release.read_release(p)  # every fact below checked there, once
        manifest, opts = rel.manifest, rel.fill_options()
        return MapsSource({l: (m["weight"], m["bias"]) for l, m in rel.maps.items()}, rel.split,
                          manifest["model"]["fingerprint"], "release:" + recipe_id(manifest["files"]),
                          frozenset(manifest["fit"].get("calibration_sha256", [])), p, rel.state_offsets,
                          None if rel.protected is None else frozenset(rel.protected.tolist()),
                          anchor=opts["anchor"], exact_norm=opts["exact_norm"], configuration=rel.configuration["arm"],
                          row_share=opts.get("row_share", ROW_SHARE), map_kinds=opts["map_kinds"], release=rel,
                          states=tuple(opts.get("states", ())))
    art = store.get(source)
    if art.stage not in ("solve", "quantize"):
        raise BadInput(f"artifact {art.id} is a {art.stage} artifact; eval takes a release folder, solve or quantize artifact")
    from ridgefill.capture.artifact import calibration_hashes
    from ridgefill.quantize.artifact import float_maps
    from ridgefill.solve.artifact import load_exact_norm, load_extras, load_map_kinds, load_states

    maps = float_maps(art)  # int8 decoded with the artifact's own group size
    cap = store.upstream(art, "capture")
    calib = calibration_hashes(cap)
    sol = art if art.stage == "solve" else store.upstream(art, "solve")
    offsets, table = load_extras(sol)
    states = load_states(sol)
    # the split and the model from the recipes, which the ids cover (never from an artifact's `info`)
    return MapsSource(maps, int(sol.recipe["split"]), sol.recipe["model"], f"{art.stage}:{art.id}", calib, None, offsets,
                      None if table is None else frozenset(table),
                      **fit_rows(cap.recipe["skip_first"], load_exact_norm(sol), f"solve {sol.id}"),
                      map_kinds=load_map_kinds(sol), states=tuple(states) if len(states) > 1 else ())
