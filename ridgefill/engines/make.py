"""`ridgefill engine prefix` and `ridgefill engine fold`: an engine cache folder (docs/engines.md) from a release and
a prompt, or from a fold artifact and a question.

The folder holds `cache.safetensors` (format `ridgefill-cache/1`, float32 unless asked otherwise) and
`prompt.safetensors` (`ids`: the token ids to send the engine; metadata `cached`: how many of them the cache holds,
and `kind`). It is built in a sibling folder and renamed into place; an existing engine-cache folder is replaced
only with --force, and anything else at --out is refused before any work.
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.formats.release.folder import check_out_dir, move_into_place, staging_dir
from ridgefill.formats.release.names import KSCALE_CONFIGURATION, ROWS_CONFIGURATION
from ridgefill.engines.prepare import PROMPT, EngineCache, present_fold, prefix_cache


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, a non-empty folder other than an engine cache, or (without --force) one."""
    check_out_dir(out, PROMPT, "an engine cache folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"--out {out} already holds an engine cache (--force replaces it)")


def check_dtype(dtype: str) -> None:
    if dtype not in ("float32", "float16", "bfloat16"):
        raise BadInput(f"--cache-dtype must be float32, float16 or bfloat16, got {dtype!r}")


def write(ec: EngineCache, out: Path, dtype: str) -> None:
    tmp = staging_dir(out)
    ec.save(tmp, dtype)
    move_into_place(tmp, out)


def make_prefix(store, model: str, release: Path, prompt: Path, out: Path, *, arm: str = "ridgefill",
                tail: int | None = None, dtype: str = "float32", force: bool = False, place=None) -> EngineCache:
    """The prefix of `prompt` (a text file, tokenized with the tokenizer's default special tokens) computed by
    `arm` with the release's maps and options, all but the last `tail` tokens (default: the release's tail). A
    release configured ridgefill+rows or ridgefill+kscale is refused for the fill arms: both need the tail, which the
    engine computes (a ridgefill+protected release's protected rows run exactly in the prefix)."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.models.device import where
    from ridgefill.runtime import load_release_maps

    check_out(out, force)
    check_dtype(dtype)
    if arm not in ("exact", "ridgefill", "identity"):
        raise BadInput(f"--arm must be ridgefill, identity or exact, not {arm!r}")
    if not prompt.is_file():
        raise BadInput(f"--prompt {prompt} is not a file")
    text = prompt.read_text(encoding="utf-8", errors="replace")
    place = place or where()
    lm = load_model(resolve_model(model, store_root=store.root), store_root=store.root, **place.load_args())
    rel = load_release_maps(lm, release)
    if arm != "exact" and rel.configuration in (ROWS_CONFIGURATION, KSCALE_CONFIGURATION):
        raise BadInput(f"{release} is configured {rel.configuration}, which a prefix cannot apply (it needs the tail, "
                       "which the engine computes); --arm exact serves its prefix exactly")
    opts = {**rel.options(), **({"tail": tail} if tail is not None else {})}
    ids = lm.tokenizer(text)["input_ids"]
    if not 0 < opts["tail"] < len(ids):
        raise BadInput(f"the prompt has {len(ids)} tokens: the tail ({opts['tail']}) must leave a prefix (--tail)")
    if arm == "exact":
        opts = {"tail": opts["tail"]}
    elif arm == "identity":
        opts.pop("maps")
    ec = prefix_cache(lm, ids, arm, **opts)
    write(ec, out, dtype)
    return ec


def make_fold(store, fold_ref: str, question: str, out: Path, *, dtype: str = "float32", force: bool = False,
              model: str | None = None, place=None) -> EngineCache:
    """The fold artifact's cache presented as r placeholder positions, followed by `question` (text, tokenized
    without special tokens, as the fold's own check does)."""
    from ridgefill.fold import artifact
    from ridgefill.models import load_model, resolve_model
    from ridgefill.models.device import where

    check_out(out, force)
    check_dtype(dtype)
    fold = store.get(fold_ref, stage="fold")
    comp = store.get(fold.recipe["compact"], stage="compact")
    spec = model or fold.info["model_spec"]
    ref = resolve_model(spec, store_root=store.root, expect=comp.recipe["model"])
    if ref.fingerprint != comp.recipe["model"]:
        raise BadInput(f"fold {fold.id} was made with a different model (fingerprint {comp.recipe['model'][:12]}) "
                       f"than '{spec}' ({ref.fingerprint[:12]})")  # fmt: skip
    place = place or where()
    lm = load_model(ref, store_root=store.root, **place.load_args())
    qids = lm.tokenizer(question, add_special_tokens=False)["input_ids"]
    if not qids:
        raise BadInput("--question is empty: the engine must compute at least one position")
    ec = present_fold(lm, artifact.load_cache(fold), len(artifact.load_context(fold)), qids)
    write(ec, out, dtype)
    return ec

