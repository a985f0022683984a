"""The capture artifact (docs/store.md): its file names, how its files are written and read, the tokenizing every
stage shares with it, and the model it was made with. Later stages read a capture only through this module.

    stats.safetensors          float64 moments per (variant, split) of the late layers' inputs:
                               `<variant>.split<S>.<field>` (capture/stats.py), and of the late attention layers' keys
                               and values: `<variant>.split<S>.kv.<field>` (since format 4); metadata {splits,
                               variants, num_layers, kv_layers}
    heldout.safetensors.zst    held-out rows: `hidden.<l>` float32 [rows, d] for every layer from the lowest split,
                               `doc`, `pos` int32 [rows]; metadata {layers}
    token_counts.safetensors   `counts` int64 [vocab]: unigram counts of the calibration documents (raw)
    documents.json             [{name, sha256, tokens, role: calibration | held_out}]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Artifact, Store
from ridgefill.artifacts.store import write_json
from ridgefill.capture.corpus import Corpus
from ridgefill.capture.stats import INPUT, Moments, merge, mix, select_x
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors

STATS = "stats.safetensors"
HELDOUT = "heldout.safetensors.zst"
COUNTS = "token_counts.safetensors"
DOCS = "documents.json"
CALIBRATION, HELD_OUT = "calibration", "held_out"  # documents.json roles


# ------------------------------------------------------------------------------------------------ writing


def stats_prefix(key: tuple) -> str:
    """The tensor-name prefix of one set of moments: key (variant, split, target) -> `<variant>.split<S>` for the
    late layers' inputs, `<variant>.split<S>.kv` for their keys and values (stats.INPUT, stats.KV)."""
    variant, split, target = key
    return f"{variant}.split{split}" + ("" if target == INPUT else f".{target}")


def write_stats(path: Path, moments: dict[tuple, Moments], splits, num_layers: int, kv_layers, earlier=()) -> None:
    """stats.safetensors from {(variant, split, target): Moments}; `kv_layers`: the late attention layers whose keys
    and values the "kv" moments hold (in order); `earlier`: the offsets of the states stacked under each split's
    (recorded only when there are some)."""
    arrays: dict[str, np.ndarray] = {}
    for key, m in moments.items():
        arrays.update(m.to_arrays(stats_prefix(key)))
    variants = list(dict.fromkeys(key[0] for key in moments))
    meta = {"splits": ",".join(map(str, splits)), "variants": ",".join(variants), "num_layers": str(num_layers),
            "kv_layers": ",".join(map(str, kv_layers))}
    if earlier:
        meta["earlier"] = ",".join(map(str, earlier))
    safetensors.save(path / STATS, arrays, meta)


def write_heldout(path: Path, rows: dict[str, np.ndarray], layers) -> None:
    safetensors.save_zst(path / HELDOUT, rows, {"layers": ",".join(map(str, layers))})


def write_counts(path: Path, raw: list[np.ndarray], calib: list[int], vocab: int) -> None:
    counts = np.zeros(vocab, dtype=np.int64)
    for i in calib:
        counts += np.bincount(np.asarray(raw[i], dtype=np.int64), minlength=vocab)[:vocab]
    safetensors.save(path / COUNTS, {"counts": counts})


def write_documents(path: Path, corpus: Corpus, ids, calib, held) -> None:
    role = {i: CALIBRATION for i in calib} | {i: HELD_OUT for i in held}
    write_json(path / DOCS, [{"name": d.name, "sha256": d.sha256, "tokens": len(ids["raw"][i]), "role": role[i]}
                             for i, d in enumerate(corpus.documents)])


# ------------------------------------------------------------------------------------------------ reading


def captured_earlier(art: Artifact) -> tuple[int, ...]:
    """The offsets k of the earlier states h_{S-k} the capture stacked under each split's state (--earlier)."""
    return tuple(art.recipe.get("earlier", ()))


def state_index(art: Artifact, earlier, d: int) -> np.ndarray | None:
    """The columns of the capture's stacked state [h_S; h_{S-k1}; ...] (d wide each) that hold h_S and then the
    earlier states `earlier` (offsets, in that order); None when that is the whole stacked state. BadInput for an
    offset the capture has not."""
    have = captured_earlier(art)
    missing = [k for k in earlier if k not in have]
    if missing:
        held = f"offsets {', '.join(map(str, have))}" if have else "none"
        raise BadInput(f"--earlier {', '.join(map(str, missing))}: capture {art.id} has no such earlier state (it "
                       f"has {held}; capture with --earlier)")
    blocks = [0, *(1 + have.index(k) for k in earlier)]
    if blocks == list(range(1 + len(have))):
        return None
    return np.concatenate([np.arange(b * d, (b + 1) * d) for b in blocks])


def load_stats(art: Artifact, split: int, chat_share: float | None = None, target: str = INPUT,
               earlier=None) -> Moments:
    """The capture's moments for one split and target (stats.INPUT: the late layers' inputs; stats.KV: the late
    attention layers' keys and values, `kv_layers` of them); raw and chat statistics mixed by `chat_share`. Their x
    is the split state with the earlier states `earlier` (offsets; None: every one the capture has) under it."""
    m = _load_stats(art, split, chat_share, target)
    if earlier is None:
        return m
    idx = state_index(art, earlier, m.mean_x.shape[0] // (1 + len(captured_earlier(art))))
    return m if idx is None else select_x(m, idx)


def _load_stats(art: Artifact, split: int, chat_share: float | None, target: str) -> Moments:
    arrays, meta = safetensors.load(art.file(STATS))
    splits = [int(s) for s in meta["splits"].split(",")]
    if split not in splits:
        raise BadInput(f"capture {art.id} has no split {split} (it has {', '.join(map(str, splits))})")
    if target != INPUT and f"{stats_prefix(('raw', split, target))}.n" not in arrays:
        raise BadInput(f"capture {art.id} has no key/value statistics at split {split} (made before capture format 4, "
                       "or no attention layer is above the split): capture again, or solve with --maps input")
    raw = Moments.from_arrays(arrays, stats_prefix(("raw", split, target)))
    if "chat" not in meta["variants"].split(","):
        if chat_share not in (None, 0.0):
            raise BadInput(f"--chat-share: capture {art.id} has no chat statistics (capture with --chat)")
        return raw
    chat = Moments.from_arrays(arrays, stats_prefix(("chat", split, target)))
    if chat_share is None:
        return merge(raw, chat)
    if not 0.0 <= chat_share <= 1.0:
        raise BadInput("--chat-share must be between 0 and 1")
    return mix(raw, chat, chat_share)


def kv_layers(art: Artifact, split: int) -> list[int]:
    """The late attention layers above `split` whose keys and values the capture's "kv" moments hold, in order."""
    meta = safetensors.read_header(art.file(STATS))[1]
    return [l for l in map(int, filter(None, meta.get("kv_layers", "").split(","))) if l >= split]


def load_heldout(art: Artifact) -> dict[str, np.ndarray]:
    if not art.file(HELDOUT).is_file():
        raise BadInput(f"capture {art.id} has no held-out rows (capture with --held-out N, N >= 1)")
    arrays, _ = safetensors.load_zst(art.file(HELDOUT))
    return arrays


def load_counts(art: Artifact) -> np.ndarray | None:
    """The calibration text's unigram counts [vocab] int64, or None for a capture without them (every capture
    writes them; a hand-built one may not)."""
    if COUNTS not in (art.manifest.get("files") or {}):
        return None
    return safetensors.load(art.file(COUNTS))[0]["counts"]


def documents(art: Artifact) -> list[dict]:
    """documents.json: [{name, sha256, tokens, role}] in corpus order."""
    return json.loads(art.file(DOCS).read_text())


def calibration_hashes(art: Artifact) -> frozenset:
    """The sha256 of every calibration document: text that must not be used to measure what was fitted on it."""
    return frozenset(d["sha256"] for d in documents(art) if d["role"] == CALIBRATION)


def pick_split(cap: Artifact, split: int | None) -> int:
    """The split to solve: the capture's only one, or `split` if the capture has it (BadInput otherwise)."""
    splits = cap.recipe["splits"]
    if split is None:
        if len(splits) > 1:
            raise BadInput(f"capture {cap.id} has splits {', '.join(map(str, splits))}: pass --split")
        return splits[0]
    if split not in splits:
        raise BadInput(f"capture {cap.id} has no split {split} (it has {', '.join(map(str, splits))})")
    return split


# ------------------------------------------------------------------------------------------- tokenizing


def tokenize(tok, corpus: Corpus, chat: bool, max_length: int | None) -> dict[str, list]:
    """Token ids per document as int32 arrays (4 bytes a token: the only thing that grows with the corpus),
    truncated to `max_length`; "full_length" keeps each raw document's untruncated length for the report."""
    cut = lambda x: np.asarray(x[:max_length] if max_length else x, dtype=np.int32)  # noqa: E731
    raw = [tok(d.text, add_special_tokens=True)["input_ids"] for d in corpus.documents]
    ids = {"raw": [cut(x) for x in raw], "full_length": [len(x) for x in raw]}
    if chat:
        if not getattr(tok, "chat_template", None):
            raise BadInput("--chat: the model's tokenizer has no chat template")
        ids["chat"] = []
        for d in corpus.documents:
            enc = tok.apply_chat_template([{"role": "user", "content": d.text}], tokenize=True)
            ids["chat"].append(cut(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return ids


# ------------------------------------------------------------------------------------ the captured model


def model_info(ref) -> dict:
    """What a capture records about its model (`info.model`)."""
    return {"name": ref.name, "revision": ref.revision, "model_type": ref.model_type,
            "num_layers": ref.num_layers, "hidden_size": ref.hidden_size, "fingerprint": ref.fingerprint}


def captured_model(cap: Artifact, store: Store, model: str | None = None):
    """The ModelRef a later stage computes with: the captured model (a Hub model pinned to the commit it was
    captured at), or `model` if it has the same fingerprint (BadInput otherwise)."""
    from ridgefill.models import resolve_model
    from ridgefill.models.spec import pinned_spec

    spec = model or pinned_spec(cap.info["model_spec"], cap.info["model"].get("revision"))
    ref = resolve_model(spec, store_root=store.root, expect=cap.recipe["model"])
    if ref.fingerprint != cap.recipe["model"]:
        raise BadInput(
            f"capture {cap.id} was made with a different model ({cap.info['model']['name']}, fingerprint "
            f"{cap.recipe['model'][:12]}) than '{spec}' (fingerprint {ref.fingerprint[:12]})"
        )
    return ref


def captured_kinds(cap: Artifact, store: Store, ref) -> list[str]:
    """The layer kinds of the captured model `ref` (from `captured_model`, so checked against the fingerprint the
    capture id covers), read from its configuration. A later stage describes the model from these and from `ref`,
    never from the capture's `info`: that is a record for people, outside the id."""
    from ridgefill.models.load import layer_kinds

    return layer_kinds(ref, store_root=store.root, trust_remote_code=cap.recipe.get("trust_remote_code", False))


def open_model(cap: Artifact, store: Store, ref, place=None):
    """Load the captured model, with the capture's own trust_remote_code choice (from its recipe, which its id
    covers), where `place` says (a ridgefill.models.device.Where; default the CPU in float32)."""
    from ridgefill.models import load_model
    from ridgefill.models.device import Where

    place = place or Where()
    return load_model(ref, store_root=store.root, trust_remote_code=cap.recipe.get("trust_remote_code", False),
                      **place.load_args())


def warn_if_mixed(cap: Artifact, place, out) -> None:
    """One warning line when the held-out rows were captured on another device kind or dtype than we score on."""
    from ridgefill.models.device import recorded, warn_mixed

    warn_mixed(out, f"capture {cap.id}", recorded(cap.recipe), place)
