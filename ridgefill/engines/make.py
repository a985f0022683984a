"""`ridgefill engine prefix` and `ridgefill engine fold`: an engine cache folder (docs/engines.md) from a release and
a prompt, or from a fold artifact and a question.

The folder holds `cache.safetensors` (format `ridgefill-cache/2`, float32 unless asked otherwise) and
`prompt.safetensors` (`ids`: the token ids to send the engine; metadata `cached`: how many of them the cache holds,
and `kind`). It is built in a sibling folder and renamed into place; an existing engine-cache folder is replaced
only with --force, and anything else at --out is refused before any work, as is an --out inside a release folder or
the artifact store (neither would verify with it there). The release, the prompt and the tail are checked before the
model is loaded (a GGUF model's first load writes its dequantized copy into the store); a prompt longer than the
model's context is refused once the tokenizer has counted it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ridgefill.artifacts import lock
from ridgefill.capture.corpus import decode_text
from ridgefill.errors import BadInput
from ridgefill.formats.release.folder import check_out_dir, move_into_place, staging_dir
from ridgefill.formats.release.names import KSCALE_CONFIGURATION, MANIFEST, ROWS_CONFIGURATION
from ridgefill.engines.prepare import PROMPT, EngineCache, present_fold, prefix_cache


def check_place(out: Path, store_root: Path | None, what: str) -> None:
    """Refuse an --out inside the artifact store at `store_root` or inside a release folder (a folder holding
    ridgefill.json at any depth above it, as written or as linked): neither would verify with `what` written there."""
    where = Path(out).resolve()
    if store_root is not None:
        root = Path(store_root).resolve()
        if where == root or root in where.parents:
            raise BadInput(f"--out {out} is inside the artifact store {store_root}: write {what} elsewhere (the store "
                           "holds only its artifacts)")
    for folder in [*Path(os.path.abspath(out)).parents, *where.parents]:  # as written (for the message), as linked
        if (folder / MANIFEST).is_file():
            raise BadInput(f"--out {out} is inside the release folder {folder}: write {what} elsewhere (a release "
                           "holds only the files its manifest lists)")


@contextmanager
def claimed(out: Path, shown: Path | None = None) -> Iterator[None]:
    """Hold --out's lock for a whole run (`.<name>.lock` beside it, the lock export and pull take while they put a
    folder in place): a second run into the same --out is refused at once instead of replacing the first's folder
    unseen when it is done. A lock file that no live process holds (a killed run's) is taken over. `shown`: --out
    as the user wrote it, for the message (`out` may be where a link leads)."""
    path = out.parent / f".{out.name}.lock"
    if not lock.acquire(path, wait=False):
        who = lock.describe(lock.holder(path))
        raise BadInput(f"--out {shown or out} is being written by {who}: wait for it to finish (then --force replaces "
                       "its folder), or write elsewhere")
    try:
        yield
    finally:
        lock.release(path)


def check_out(out: Path, force: bool, store_root: Path | None = None) -> None:
    """Refuse an --out inside the artifact store at `store_root` or inside a release folder, a file, a non-empty
    folder other than an engine cache, or (without --force) one."""
    check_place(out, store_root, "the engine cache")
    check_out_dir(out, PROMPT, "an engine cache folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"--out {out} already holds an engine cache (--force replaces it)")


def check_dtype(dtype: str) -> None:
    if dtype not in ("float32", "float16", "bfloat16"):
        raise BadInput(f"--cache-dtype must be float32, float16 or bfloat16, got {dtype!r}")


def tail_rule(tail: int, tokens: int | None = None, given: bool = True) -> str:
    """The refusal of a tail that leaves the engine nothing to compute or the cache nothing to hold: the rule is
    1 <= tail < the prompt's tokens. `given`: the tail came from --tail (else from the release)."""
    if not given:
        return f"the release's tail ({tail}) must be less than the prompt's {tokens} tokens; --tail sets another"
    if tokens is None:
        return f"--tail {tail}: the tail must be at least 1 and less than the prompt's length in tokens"
    return (f"--tail {tail}: the tail must be at least 1 and less than the prompt's {tokens} tokens "
            f"(1 <= tail < {tokens})")


def read_prompt_text(path: Path, warn=None) -> str:
    """The text of a --prompt file; bytes that are not UTF-8 are replaced with U+FFFD and `warn` is told, as
    capture tells of its corpus. BadInput for a missing file or one without text."""
    if not path.is_file():
        raise BadInput(f"--prompt {path} is not a file")
    text, replaced = decode_text(path.read_bytes())
    if replaced and warn is not None:
        warn(f"--prompt {path} had non-UTF-8 bytes; {replaced} replaced with U+FFFD")
    if not text.strip():
        raise BadInput(f"--prompt {path} holds no text")
    return text


def check_context(lm, tokens: int, what: str) -> None:
    """Refuse more positions than the model's context (its config's max_position_embeddings)."""
    limit = lm.context_length()
    if limit and tokens > limit:
        raise BadInput(f"{what} {tokens} tokens, more than the model's context ({limit} positions)")


def write(ec: EngineCache, out: Path, dtype: str) -> None:
    tmp = staging_dir(out)
    ec.save(tmp, dtype)
    move_into_place(tmp, out)


def make_prefix(store, model: str, release: str | Path, prompt: Path, out: Path, *, arm: str = "ridgefill",
                tail: int | None = None, dtype: str = "float32", force: bool = False, place=None,
                warn=None) -> EngineCache:
    """The prefix of `prompt` (a text file, tokenized with the tokenizer's default special tokens) computed by
    `arm` with the release's maps and options, all but the last `tail` tokens (default: the release's tail). A
    release configured ridgefill+rows or ridgefill+kscale is refused for the fill arms: both need the tail, which the
    engine computes (a ridgefill+protected release's protected rows run exactly in the prefix). `warn` is told of
    bytes in the prompt that are not UTF-8. `release` is a folder, or `hf://owner/name[@rev]`
    (`hub.releases.locate_release`: pulled into the release cache; a missing folder refused, never fetched)."""
    from ridgefill.formats.release import read_release
    from ridgefill.hub.releases import locate_release
    from ridgefill.models import load_model, resolve_model
    from ridgefill.models.device import where
    from ridgefill.runtime import load_release_maps

    check_out(out, force, store.root)
    check_dtype(dtype)
    if arm not in ("exact", "ridgefill", "identity"):
        raise BadInput(f"--arm must be ridgefill, identity or exact, not {arm!r}")
    if tail is not None and tail < 1:
        raise BadInput(tail_rule(tail))
    text = read_prompt_text(prompt, warn)
    # the release is verified, its configuration and model checked, before the model is loaded
    release = locate_release(os.fspath(release))
    verified = read_release(release)
    conf = verified.configuration["arm"]
    if arm != "exact" and conf in (ROWS_CONFIGURATION, KSCALE_CONFIGURATION):
        raise BadInput(f"{release} is configured {conf}, which a prefix cannot apply (it needs the tail, which the "
                       "engine computes); --arm exact serves its prefix exactly")
    ref = resolve_model(model, store_root=store.root, expect=verified.manifest["model"]["fingerprint"])
    verified.check_model(fingerprint=ref.fingerprint, num_layers=ref.num_layers, hidden_size=ref.hidden_size,
                         num_kv_heads=None, head_dim=None, vocab_size=None, name=model, where=str(release))
    place = place or where()
    lm = load_model(ref, store_root=store.root, **place.load_args())
    rel = load_release_maps(lm, release, verified)  # checked against the loaded model's KV shape too; not read again
    opts = {**rel.options(), **({"tail": tail} if tail is not None else {})}
    ids = lm.tokenizer(text)["input_ids"]
    check_context(lm, len(ids), "the prompt has")
    if not 0 < opts["tail"] < len(ids):
        raise BadInput(tail_rule(opts["tail"], len(ids), tail is not None))
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

    check_out(out, force, store.root)
    check_dtype(dtype)
    if not question:
        raise BadInput("--question is empty: the engine must compute at least one position")
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
    context = len(artifact.load_context(fold))
    check_context(lm, context + len(qids), f"the fold's context ({context} tokens) and the question run to")
    ec = present_fold(lm, artifact.load_cache(fold), context, qids)
    write(ec, out, dtype)
    return ec

