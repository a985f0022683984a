"""`ridgefill export --format gguf`: the maps of a release as one GGUF file (ridgefill.formats.gguf).

The GGUF carries the facts of a verified release (a release folder, or the export artifact that `ridgefill
export` builds from a quantize or solve artifact: facts are only ever read through `release.load_release`),
is built as its own export artifact in the store (recipe: format "gguf" + the release artifact's id, or the
release manifest's sha256) and copied to `--out FILE.gguf`.

Which float maps are quantized:
- from the store (a quantize or solve artifact): the solve artifact's float maps W, b (for a quantize
  artifact, the solve upstream of it: its int8 codes are not re-quantized, so there is one rounding, not two),
  with the bias correction `quantize` applies to int8 (b_q = b + (W - W_q) mean_x, float64, stored F32). mean_x
  is the capture's mean split state, mixed as the solve mixed it. The projector facts in the metadata
  (ridgefill.projector.*) describe the release, not this file's Q8_0 weights.
- from a release folder: the release's maps as decoded (for int8, codes * bf16 scales, re-quantized) and
  the release's bias unchanged (its int8 correction stays; a release folder does not carry the calibration
  mean, so the Q8_0 step adds no correction of its own).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import canonical_json, sha256_file
from ridgefill.errors import BadInput
from ridgefill.export.artifact import GGUF_FILE, release_files
from ridgefill.export.config import ExportConfig
from ridgefill.quantize.artifact import load_quant
from ridgefill.formats import release
from ridgefill.formats.gguf import MAGIC, check_row_length, encode_tensors, extra_tensors, write_gguf
from ridgefill.output import Output
from ridgefill.solve import artifact as solved

FORMAT_VERSION = 4  # 2: from the store, Q8_0 of the float maps with the bias correction; release facts hashed;
# 3: the protected-token table and terminal-state offsets ride along; 4: layout ridgefill-maps-gguf/2, the layers' map
# kinds (ridgefill.layer_maps) of a ridgefill-maps/2 release; a ridgefill-maps/3 release's as layout /3


def export_gguf(store: Store, ref: str, cfg: ExportConfig, out: Output, *, out_path: Path | None = None,
                force: bool = False, model: str | None = None) -> tuple[Artifact, bool, Path | None]:
    """Build (or reuse) the GGUF export artifact of a quantize/solve artifact or a release folder; copy it to
    `out_path` (a .gguf file) if given. Returns (artifact, cached, path written or None). `cfg` (export/config.py)
    goes to the release built from the store (`build.export`), whose facts, its `configuration` among them, the
    GGUF carries; a release folder carries its own facts, and a configuration, sweep or row share is refused with
    one."""
    from ridgefill.export import build

    target = _check_target(Path(out_path)) if out_path is not None else None
    folder = Path(ref)
    maps = None
    if (folder / release.MANIFEST).is_file():
        if (cfg.configuration, cfg.sweep, cfg.row_share) != (None, None, None):
            raise BadInput(f"{folder} is a release folder, which records its own configuration: --configuration, "
                           "--sweep and --row-share apply to an export from the store")
        rel = release.read_release(folder)  # verified; --tail does not apply: the release has its own
        manifest, maps, extras = rel.manifest, rel.maps, extra_tensors(rel.state_offsets, rel.protected)
        for layer, m in sorted(maps.items()):
            check_row_length(layer, m["weight"].shape[1])
        source, provenance = "release:" + hashlib.sha256(canonical_json(manifest).encode()).hexdigest(), {}
        info = {"release_manifest_sha256": source.split(":")[1]}
    else:
        src = store.get(ref)
        if src.stage in ("quantize", "solve"):
            for layer, d_in in _source_row_lengths(src):
                check_row_length(layer, d_in)
        rel, _, _ = build.export(store, ref, cfg, out, model=model)
        source = f"export/{rel.id}"
        sol = store.upstream(src, "solve")
        provenance = {"source_artifact": f"{src.stage}/{src.id}", "release_artifact": source,
                      "float_maps_artifact": f"solve/{sol.id}"}
        info = {"source": src.id, "release": rel.id, **{k: rel.info[k] for k in ("solve", "capture") if k in rel.info}}
    recipe = {"stage": "export", "version": FORMAT_VERSION, "format": "gguf", "source": source}
    art = store.cached("export", recipe)
    cached = art is not None
    if not cached:
        mean_x = None
        if maps is None:
            manifest, _, extras = _load_release_artifact(rel)  # the facts, verified as a user's release would be
            maps, mean_x = float_maps_and_mean(store, sol, manifest)
        tensors, errors = encode_tensors(maps, mean_x)
        tensors += extras
        with store.build("export", recipe) as b:
            write_gguf(b.path / GGUF_FILE, manifest, tensors, provenance)
            summary = {"format": "gguf", "split": manifest.get("split"), "files": [GGUF_FILE],
                       "tensors": len(tensors), "bytes": (b.path / GGUF_FILE).stat().st_size,
                       "bias_correction": mean_x is not None,
                       "q8_0_max_abs_error": max(e["max_abs"] for e in errors.values()),
                       "q8_0_max_rel_error_worst": max(e["max_rel"] for e in errors.values())}
            art = b.commit(info={**info, "gguf_py": _gguf_version(), "q8_0_errors": errors}, summary=summary)
    copied = _copy_out(art, target, force, out) if target is not None else None
    return art, cached, copied


def float_maps_and_mean(store: Store, sol: Artifact, manifest: dict) -> tuple[dict, np.ndarray]:
    """The solve artifact's float maps ({layer: {weight, bias}} float32) and its calibration mean (float64
    [d_in]), checked against the release's facts (same layers, same split)."""
    store.verify(sol)
    maps = {l: {"weight": w, "bias": b} for l, (w, b) in solved.load_maps(sol).items()}
    layers = [x["index"] for x in manifest.get("layers", [])]
    if layers != sorted(maps) or manifest.get("split") != sol.manifest["summary"]["split"]:
        raise BadInput(f"solve artifact {sol.id} does not match the release built from it (layers {sorted(maps)}, "
                       f"split {sol.manifest['summary']['split']})")
    return maps, solved.calibration_mean(store, sol)


def _source_row_lengths(src: Artifact) -> list[tuple[int, int]]:
    """(layer, d_in) of a quantize or solve artifact's maps, read before anything is built."""
    if src.stage == "quantize":
        return [(l, q["codes"].shape[1]) for l, q in sorted(load_quant(src).items())]
    return [(l, w.shape[1]) for l, (w, _) in sorted(solved.load_maps(src).items())]


def _load_release_artifact(rel: Artifact) -> tuple[dict, dict, list]:
    """Load the store's release artifact as a user loads a release: its files (not artifact.json) in a folder.
    Returns (manifest, maps, its extra tensors for the GGUF)."""
    with tempfile.TemporaryDirectory(prefix="ridgefill-gguf-") as tmp:
        for name in release_files(rel.path):
            shutil.copyfile(rel.path / name, Path(tmp) / name)
        rel = release.read_release(Path(tmp))
        return rel.manifest, rel.maps, extra_tensors(rel.state_offsets, rel.protected)


def _gguf_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return None


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def _check_target(path: Path) -> Path:
    """--out must name a .gguf file; an existing one is only ever replaced if it is a GGUF file."""
    if path.suffix.lower() != ".gguf":
        raise BadInput(f"--out {path}: with --format gguf, --out names the .gguf file to write (e.g. maps.gguf)")
    if path.parent.exists() and not path.parent.is_dir():
        raise BadInput(f"--out {path}: {path.parent} is not a directory")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise BadInput(f"--out {path} exists and is not a regular file")
        if not _is_gguf(path):
            # even --force only ever replaces a GGUF file, so a mistyped --out never destroys another file
            raise BadInput(f"--out {path} exists and is not a GGUF file; refusing to replace it")
    return path


def _copy_out(art: Artifact, target: Path, force: bool, out: Output) -> Path:
    """Copy the artifact's file to target (temp sibling, then rename). An identical file there is left alone."""
    src = art.path / GGUF_FILE
    if target.is_file():
        if sha256_file(target) == art.manifest["files"][GGUF_FILE]["sha256"]:
            out.info(f"{target} already holds this file; left alone")
            return target
        if not force:
            raise BadInput(f"--out {target} holds a different GGUF file; pass --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
