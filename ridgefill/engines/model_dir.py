"""`ridgefill engine model MODEL --out DIR`: a Hugging Face model folder that vLLM serves, for a model that is not
one (a GGUF file, the built-ins included), with a marker that says which model it was written from.

The folder holds what transformers' `save_pretrained` writes for the model and its tokenizer -- `config.json`,
`generation_config.json` (when the model has one), the weights as `model.safetensors` (shards and an index above
transformers' 50 GB shard size), `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` (when the model
has a chat template) -- and `ridgefill-model.json` (ridgefill/engines/identity.py): the folder's own fingerprint,
the source model's spec, name and fingerprint, and the dtype. The vLLM plugin accepts the folder for a release of
the source model through that marker (`identity.served_fingerprint_problem`).

The weights are the model as ridgefill loads it: a GGUF is dequantized by transformers (once, into
`<store>/models/`), to float32. `--dtype auto` keeps float32: those are the weights the release's maps were fitted
on and measured with, and bfloat16 or float16 would round them. `--dtype bfloat16` halves the folder, for an engine
that runs in bfloat16 anyway; float16 is refused when a weight overflows it.

Refused before anything is written (exit 2): a model that already is a Hugging Face folder (a local folder or a
Hub id: vLLM serves it as it is, and its own fingerprint is its releases'), an architecture the plugin does not
serve (llama, qwen2, qwen3 only), a model with sliding-window or recurrent layers (an engine keeps one position
range for all layers, as for `engine prefix`), an unknown dtype, an --out inside a release folder or the artifact
store (neither would verify with it there), an --out another run is writing (its lock, held for the whole run), and
an existing --out without --force (a non-empty folder that is not an engine model folder, even with --force). The
folder is written into a temporary sibling and renamed into place (ridgefill.formats.release.folder): --out holds
either the old folder or the new one, never a part, and what a killed run left beside it is put back or removed by
the next run. A linked --out is the folder it leads to: that folder is replaced, and the link still leads to it.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.formats.release.folder import check_out_dir, move_into_place, recover, staging_dir
from ridgefill.engines.identity import MARKER, marker_bytes
from ridgefill.engines.make import check_place, claimed

DTYPES = ("auto", "float32", "bfloat16", "float16")
SERVED_ARCHS = ("llama", "qwen2", "qwen3")  # what the vLLM plugin serves


@dataclass
class ModelDir:
    """A written engine model folder: where, its fingerprint, what it came from, its files and the time taken."""

    out: Path
    dtype: str  # the weights' dtype (auto resolved)
    fingerprint: str  # the folder's own (dir_fingerprint), as its marker records it
    source: dict  # {"spec", "name", "fingerprint"} of the model it was written from
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    seconds: dict[str, float] = field(default_factory=dict)  # load, write, fingerprint, total
    built_cache: bool = False  # whether this run dequantized the GGUF into the store

    @property
    def bytes(self) -> int:
        return sum(self.files.values())


def check_dtype(dtype: str) -> str:
    """`--dtype` resolved: auto -> float32 (a GGUF's dequantized weights, unrounded)."""
    if dtype not in DTYPES:
        raise BadInput(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return "float32" if dtype == "auto" else dtype


def leads_to(out: Path) -> Path:
    """The folder --out names: where a link leads (so the new folder replaces that one and the link still leads to
    it; swapping the link itself would set the old folder aside beside the link, where nothing removes it), else
    --out itself."""
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, a non-empty folder other than an engine model folder, or (without --force)
    an engine model folder. What a killed run left beside the folder is put back or removed first."""
    recover(leads_to(out))
    check_out_dir(out, MARKER, "an engine model folder (no ridgefill-model.json)")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"--out {out} already holds an engine model folder (--force replaces it)")


def refuse_hf_folder(spec: str) -> None:
    """A local folder or a Hub id is a Hugging Face folder already: vLLM serves it as it is (refused without
    reading or downloading anything)."""
    from ridgefill.models.spec import HUB_ID

    if spec.startswith("builtin:"):
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        raise BadInput(f"'{spec}' is a model folder, which vLLM serves as it is (`vllm serve {path}`); "
                       "`engine model` writes folders for GGUF models")
    if not path.exists() and HUB_ID.match(spec) and not spec.endswith(".gguf"):
        repo, _, rev = spec.partition("@")
        serve = f"vllm serve {repo}" + (f" --revision {rev}" if rev else "")
        raise BadInput(f"'{spec}' is a Hub model, a Hugging Face folder already, which vLLM serves as it is "
                       f"(`{serve}`); `engine model` writes folders for GGUF models")


def write_model_dir(store, spec: str, out: Path, *, dtype: str = "auto", force: bool = False, info=None) -> ModelDir:
    """Write the engine model folder of the model `spec` (a GGUF file or a built-in) to `out`; `info(line)` is told
    what is being done. Returns what was written."""
    start = time.perf_counter()
    resolved = check_dtype(dtype)
    check_place(out, store.root, "the engine model folder")
    with claimed(leads_to(out), out):
        return _write(store, spec, out, resolved, force, info, start)


def _write(store, spec: str, out: Path, resolved: str, force: bool, info, start: float) -> ModelDir:
    """write_model_dir, under --out's lock."""
    from ridgefill.models import load_model, resolve_model
    from ridgefill.models.fingerprint import dir_fingerprint
    from ridgefill.models.kinds import FULL

    check_out(out, force)
    refuse_hf_folder(spec)
    ref = resolve_model(spec, store_root=store.root)
    if ref.model_type not in SERVED_ARCHS:
        raise BadInput(f"the vLLM plugin serves {', '.join(SERVED_ARCHS)} models; '{spec}' is {ref.model_type}")
    if info:
        info(f"loading {spec} as {resolved}" + (" (a GGUF is dequantized once, into the store)" if ref.is_gguf else ""))
    lm = load_model(ref, store_root=store.root, dtype=resolved, device="cpu")
    kinds = set(lm.adapter.layer_kinds)
    if kinds != {FULL}:
        raise BadInput(f"an engine needs full attention in every layer (this model has {sorted(kinds)}): it keeps "
                       "one position range for all layers")
    loaded = time.perf_counter()
    if resolved == "float16":
        _check_finite(lm.model)
    source = {"spec": spec, "name": ref.name, "fingerprint": ref.fingerprint}
    tmp = staging_dir(leads_to(out))
    try:
        lm.model.save_pretrained(tmp)  # config.json, generation_config.json, model.safetensors
        lm.tokenizer.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
        _plain_modes(tmp)
        written = time.perf_counter()
        fingerprint = dir_fingerprint(tmp)
        (tmp / MARKER).write_bytes(marker_bytes(fingerprint, source, resolved))
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        move_into_place(tmp, leads_to(out))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    end = time.perf_counter()
    seconds = {"load": loaded - start, "write": written - loaded, "fingerprint": end - written, "total": end - start}
    return ModelDir(out, resolved, fingerprint, source, files, {k: round(v, 2) for k, v in seconds.items()},
                    lm.built_cache)


def _check_finite(model) -> None:
    """float16 holds magnitudes up to 65504: a weight beyond it became infinite when the model was loaded."""
    import torch

    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise BadInput(f"float16 cannot hold the weights of {name} (beyond 65504): use --dtype bfloat16 or float32")


def _plain_modes(folder: Path) -> None:
    """Give every file a plain file's mode (0666 less the umask): transformers (5.25) writes model.safetensors
    0600, which an engine running as another user (a container's) could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            p.chmod(0o666 & ~umask)
