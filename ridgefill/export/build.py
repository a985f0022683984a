"""`ridgefill export`: a release folder (format `ridgefill-maps/1`, see ridgefill.formats.release) from a quantize
or solve artifact.

The release is built inside the store as an export artifact (content-hashed like every stage) and then
copied to `--out`: into a temporary sibling folder, swapped in by `release.move_into_place` (the same swap as
`pull`: an old release there is renamed aside and only deleted once the new one is in place, and restored if
the rename fails). The manifest gathers the model, split, layers, fit and held-out figures from the upstream
artifacts; a quantize artifact's group size is the one it was quantized with.

`configuration` (with the `sweep` that recommended it and, for ridgefill+rows, its `row_share`) records how the
release is to be applied (docs/format.md, `configuration`): a fact of the manifest, and a key of the export's recipe.
Both are left out for the plain fill without a sweep, so that such an export is the one made before configurations
existed (same id, same bytes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ridgefill.artifacts import Artifact, Store
from ridgefill.capture import artifact as captured
from ridgefill.errors import BadInput
from ridgefill.export.artifact import release_files
from ridgefill.export.config import ExportConfig
from ridgefill.quantize.artifact import group_size, load_quant
from ridgefill.export.card import model_card
from ridgefill.formats import release
from ridgefill.formats.release.names import (CONFIGURATIONS, KSCALE_CONFIGURATION, PLAIN, PROTECTED_CONFIGURATION,
                                             ROWS_CONFIGURATION, manifest_text, tail_problem)
from ridgefill.output import Output
from ridgefill.solve import artifact as solved

FORMAT_VERSION = 5  # 2: maps.safetensors records the release facts; 3: and the sha256 of the other tensor files;
# 4: `fit.exact_norm`, the solve's exact-row norm; 5: ridgefill-maps/2, each layer's map kind (`layers[].map`) and
# the model's KV heads and head_dim; maps from earlier states are ridgefill-maps/3 (`states`), the rest unchanged
RELEASE_DIR = "release"


def export(store: Store, ref: str, cfg: ExportConfig, out: Output, *, out_dir: Path | None = None,
           force: bool = False, model: str | None = None) -> tuple[Artifact, bool, Path | None]:
    """Build (or find cached) the export artifact of a quantize or solve artifact with the settings `cfg`
    (export/config.py), and copy it to `out_dir` (an identical release there, or the same release with the eval
    summary `ridgefill eval` recorded in it, is left as it is; a different one is replaced only with `force`).
    The release describes the model from the model itself (`model`, default the captured one, re-resolved and
    checked against the fingerprint the capture id covers) and the split from the solve's recipe; nothing is
    taken from an artifact's unhashed `info`. `cfg.configuration` (one of CONFIGURATIONS; default the plain fill),
    `cfg.sweep` (a sweep artifact of the store) and `cfg.row_share` (ridgefill+rows only; default the runtime's) are
    recorded as the release's `configuration` (`configuration_fact`). BadInput, before anything is written, for
    an unknown configuration, a row share that does not apply or is out of (0, 1), a sweep id that is not a sweep
    artifact, ridgefill+protected from a solve without a protected-token table, or ridgefill+kscale where every
    layer above the split is linear attention; and a tail the reader would refuse (`names.tail_problem`)."""
    tail = cfg.tail
    problem = tail_problem(tail)
    if problem is not None:
        raise BadInput(f"--tail {problem}")
    src = store.get(ref)
    if src.stage not in ("quantize", "solve"):
        raise BadInput(f"artifact {src.id} is a {src.stage} artifact; export takes a quantize or solve artifact")
    conf = configuration_fact(store, cfg.configuration, cfg.sweep, cfg.row_share)
    if out_dir is not None:
        release.check_out_dir(out_dir)
    sol = store.upstream(src, "solve")
    exact_norm = solved.load_exact_norm(sol)  # a solve made before it has none: refused before anything is written
    has_table = solved.PROTECTED in (sol.manifest.get("files") or {})
    if conf is not None and conf["arm"] == PROTECTED_CONFIGURATION and not has_table:
        raise BadInput(f"--configuration {PROTECTED_CONFIGURATION} needs a protected-token table, and solve {sol.id} "
                       "has none")
    cap = store.upstream(sol, "capture")
    if conf is not None and conf["arm"] == KSCALE_CONFIGURATION:
        _check_kscale(store, sol, cap, model)
    recipe = {"stage": "export", "version": FORMAT_VERSION, "source": f"{src.stage}/{src.id}", "tail": tail,
              **({"configuration": conf} if conf is not None else {})}
    art = store.cached("export", recipe)
    cached = art is not None
    if not cached:
        store.verify(src)
        rep = solved.load_report(sol)
        if src.stage == "quantize":
            maps, group = load_quant(src), {"group_size": group_size(src)}
        else:
            maps, group = _float_maps(src), {"weight_dtype": "f32"}
        model_ref = captured.captured_model(cap, store, model)  # a ModelRef: nothing is loaded
        manifest = _manifest(src, sol, cap, rep, captured.documents(cap), tail, model_ref,
                             captured.captured_kinds(cap, store, model_ref), sorted(maps), exact_norm,
                             solved.load_map_kinds(sol), _kv_shape(sol))
        if conf is not None:
            manifest["configuration"] = conf
        extras = _extras(sol, rep)
        with store.build("export", recipe) as build:
            release.write_release(build.path / RELEASE_DIR, maps, manifest, model_card, **group, **extras)
            _flatten(build.path / RELEASE_DIR, build.path)
            art = build.commit(info={"source": src.id, "solve": sol.id, "capture": cap.id},
                               summary={"split": manifest["split"], "files": sorted(release_files(build.path))})
    copied = None
    if out_dir is not None:
        copied = _copy_out(art, out_dir, force, out)
    return art, cached, copied


def configuration_fact(store: Store, configuration: str | None, sweep: str | None,
                       row_share: float | None) -> dict | None:
    """The release's `configuration` fact {"arm", "sweep"[, "row_share"]}, or None for the plain fill without a sweep
    (a release that records nothing: the one exported before configurations existed). `sweep` is resolved to the
    full id of a sweep artifact of `store`; ridgefill+rows records its row share (default: the runtime's). BadInput
    names the first problem."""
    from ridgefill.runtime.rows import ROW_SHARE

    arm = PLAIN if configuration is None else str(configuration).strip()
    if arm not in CONFIGURATIONS:
        raise BadInput(f"--configuration {configuration!r} is not one of: {', '.join(CONFIGURATIONS)}")
    if row_share is not None and arm != ROWS_CONFIGURATION:
        raise BadInput(f"--row-share applies to --configuration {ROWS_CONFIGURATION} only, not {arm}")
    share = ROW_SHARE if row_share is None else row_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise BadInput(f"--row-share must be a number between 0 and 1 (exclusive), got {row_share!r}")
    sweep_id = None if sweep is None else store.get(sweep, stage="sweep").id
    if arm == PLAIN and sweep_id is None:
        return None
    return {"arm": arm, "sweep": sweep_id, **({"row_share": float(share)} if arm == ROWS_CONFIGURATION else {})}


def _check_kscale(store: Store, sol: Artifact, cap: Artifact, model: str | None) -> None:
    """BadInput where the key rescale has no keys to rescale: every layer above the split is linear attention (a
    Gated DeltaNet keeps a recurrent state, no keys), as the runtime refuses the correction there."""
    from ridgefill.models.kinds import LINEAR

    split = int(sol.recipe["split"])
    kinds = captured.captured_kinds(cap, store, captured.captured_model(cap, store, model))
    if all(k == LINEAR for k in kinds[split:]):
        raise BadInput(f"--configuration {KSCALE_CONFIGURATION} rescales keys, and every layer above split {split} is "
                       "linear attention (no keys): choose another configuration")


def _flatten(rel: Path, dest: Path) -> None:
    """The artifact's files are the release's files: move them up one level."""
    for p in rel.iterdir():
        p.rename(dest / p.name)
    rel.rmdir()


def _extras(sol: Artifact, rep: dict) -> dict:
    """The solve's protected-token table and terminal-state offsets with what they were measured on, as
    write_release takes them ({} for a solve that has neither)."""
    offsets, table = solved.load_extras(sol)
    extras = {}
    if table is not None:
        extras = {"protected": table, "protected_facts": rep["protected_tokens"]}
    if offsets is not None:
        sc = rep["state_correction"]
        facts = {"chunk": sc["chunk"], "states_per_layer": sc["states_per_layer"],
                 "data_sha256": [d["sha256"] for d in sc["documents"]]}
        extras |= {"state_offsets": offsets, "state_facts": facts}
    return extras


def _float_maps(src: Artifact) -> dict:
    return {l: {"weight": w, "bias": b} for l, (w, b) in solved.load_maps(src).items()}


def _kv_shape(sol: Artifact) -> tuple[int, int]:
    """The model's (KV heads, head_dim), which a solve records since its format 6."""
    shape = solved.load_kv_shape(sol)
    if shape is None:
        raise BadInput(f"solve {sol.id} was made before solve format 6 (it does not record its model's KV heads): "
                       "solve its capture again")
    return shape


def _manifest(src: Artifact, sol: Artifact, cap: Artifact, rep: dict, docs: list, tail: int, model, kinds: list[str],
              layers: list[int], exact_norm: float, maps: dict[int, str], kv_shape: tuple[int, int]) -> dict:
    """The release's facts. `model` is the captured model's ModelRef (fingerprint-checked) and `kinds` its layer
    kinds; the split is the solve recipe's; `layers` are the maps' own layers, `maps` what each predicts; `exact_norm`
    the solve's; `kv_shape` the model's (KV heads, head_dim)."""
    split = sol.recipe["split"]
    calib = [d for d in docs if d["role"] == captured.CALIBRATION]

    def figures(scores: dict) -> dict:
        return {k: round(v, 6) for k, v in scores["mean"].items()}

    heldout = {"fitted": figures(rep["fitted"]), "identity": figures(rep["identity"]), "rows": rep["held_out_rows"],
               "metric": rep["metric"]}
    if src.stage == "quantize":
        heldout["int8_score"] = round(src.manifest["summary"]["score_int8"], 6)
        heldout["float_score"] = round(src.manifest["summary"]["score_float"], 6)
    from ridgefill.models.spec import upstream  # for the model card: base model, its license, a portable spec

    up = upstream(model.spec, model.name, model.revision)
    return {
        **({"license": up["license"]} if "license" in up else {}),
        "model": {"name": model.name, "revision": model.revision, "architecture": model.model_type,
                  "num_layers": model.num_layers, "hidden_size": model.hidden_size,
                  "fingerprint": model.fingerprint, "num_kv_heads": kv_shape[0], "head_dim": kv_shape[1],
                  **{k: up[k] for k in ("base_model", "source", "spec") if k in up}},
        "split": split,
        **({"states": states} if len(states := solved.load_states(sol)) > 1 else {}),
        "tail_default": tail,
        "layers": [{"index": l, "kind": kinds[l], "map": maps[l]} for l in layers],
        "fit": {**_ridge_setting(rep), "rows": rep["rows"], "documents": len(calib),
                "tokens": sum(d["tokens"] for d in calib),
                "calibration_sha256": sorted(d["sha256"] for d in calib),
                "capture_id": cap.id, "solve_id": sol.id, "skip_first_rows": cap.recipe["skip_first"],
                "outlier_ratio": cap.recipe.get("outlier_ratio"), "exact_norm": exact_norm,
                "chat": cap.recipe["chat"], "chat_share": sol.recipe["chat_share"]},
        "heldout": heldout,
    }


def _ridge_setting(rep: dict) -> dict:
    """The fit's alpha and lambda: `alpha`, `lambda` (one for every layer), or, for a solve with per-layer alphas,
    `alpha_per_layer`, `lambda_per_layer` ({layer: value}) and no `alpha` / `lambda`: no single alpha made the maps."""
    per = rep.get("per_layer")
    if per is None:
        return {"alpha": rep["alpha"], "lambda": rep["lambda"]}
    return {"alpha_per_layer": per["alpha"], "lambda_per_layer": per["lambda"]}


def _copy_out(art: Artifact, out_dir: Path, force: bool, out: Output) -> Path:
    """Copy the release to out_dir (temporary sibling, then `release.move_into_place`). The same release there
    (`_holds`) is left alone; a different one is only replaced with force. The look and the swap happen under
    `release.out_lock`: an export into the same --out at the same time waits, then finds this one's release."""
    names = release_files(art.path)
    with release.out_lock(out_dir, out.info):
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if _holds(out_dir, art.path, names):
                return out_dir
            if not force:
                raise BadInput(f"--out {out_dir} holds a different release; pass --force to replace it")
        tmp = release.staging_dir(out_dir)
        try:
            for n in names:
                shutil.copyfile(art.path / n, tmp / n)
            release.move_into_place(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _holds(out_dir: Path, built: Path, names: list[str]) -> bool:
    """Whether out_dir holds the release built in `built`: the same files byte for byte, or those with the figures
    `ridgefill eval` records (`release.write_eval`): ridgefill.json the built one's plus an `eval` field, README.md
    the card of that manifest. Such a folder is left as it is, so the figures stay with the release they measured.
    out_dir is untrusted: whatever it holds that cannot be read as such is another release."""
    if release.same_files(out_dir, built, names):
        return True
    if sorted(p.name for p in out_dir.iterdir()) != sorted(names):
        return False
    for n in names:
        if n not in (release.MANIFEST, release.CARD) and not (
                (out_dir / n).is_file() and (out_dir / n).read_bytes() == (built / n).read_bytes()):
            return False
    try:
        manifest = json.loads((out_dir / release.MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or "eval" not in manifest:
            return False
        facts = manifest_text({k: v for k, v in manifest.items() if k != "eval"})
        if facts != (built / release.MANIFEST).read_text(encoding="utf-8"):
            return False
        return (out_dir / release.CARD).read_text(encoding="utf-8") == model_card(manifest)
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON: not what eval writes
        return False
