"""The release a serving engine fills with (docs/engines.md, "Serving a release with vLLM"): named by
`RIDGEFILL_RELEASE`, read with the project's own release reader, and checked against the model the engine serves.

    from ridgefill.engines.vllm import served
    fill = served.from_environment()          # None when RIDGEFILL_RELEASE is unset or empty
    served.check_model(fill, config, path)    # BadInput naming the first mismatch

`RIDGEFILL_RELEASE` is a release folder, or a Hub release written `hf://owner/name[@rev]`, pulled and verified as
`ridgefill pull` does into `$RIDGEFILL_CACHE/releases` (default `~/.cache/ridgefill/releases`;
`hub.releases.locate_release`, the rule every command that takes a release has) and reused from there. A value
without `hf://` is only ever a folder: a path that does not exist is refused, never looked up on the Hub
(`release/x` typed in the wrong folder is not someone's repo).
Imports: the standard library, numpy and ridgefill's numpy-only modules (no torch, no transformers), so the engine's
own environment reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ridgefill.errors import BadInput
from ridgefill.formats.release import MAPS_FILE, read_release
from ridgefill.formats.release.names import PLAIN, PROTECTED_CONFIGURATION, integer, protected_problem
from ridgefill.hub.releases import FORMS, HUB, locate_release
from ridgefill.models.kinds import FULL

ENV = "RIDGEFILL_RELEASE"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CAUSAL = (PLAIN, PROTECTED_CONFIGURATION)  # configurations decided row by row; +rows and +kscale read the tail


@dataclass(frozen=True)
class Fill:
    """A verified release, as an engine applies it."""

    folder: Path
    manifest: dict
    sha256: str  # of maps.safetensors, whose hash covers every fact: the release's identity
    split: int
    tail: int  # the release's `tail_default`
    anchor: int  # `fit.skip_first_rows`: leading rows that run exactly
    exact_norm: float  # `fit.exact_norm`: a prefix row whose split state's norm exceeds it runs exactly
    configuration: str
    protected: np.ndarray | None  # int64 token ids whose rows run exactly (ridgefill+protected), or None
    maps: dict[int, tuple[np.ndarray, np.ndarray]]  # {layer: (W float32 [d_out, d], b float32 [d_out])}
    map_kinds: dict[int, str]  # {layer: "input" (d_out = d) | "kv" (keys before RoPE and QK-norm, then values)}
    origin: str | None = None  # where it came from when not a folder given as such: "hf://owner/name@rev"

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def projector(self) -> str:
        return self.manifest["projector"]["dtype"]

    def describe(self) -> str:
        """One line: what is on."""
        L = self.model["num_layers"]
        rule = f"split state above norm {self.exact_norm:.4g}"
        if self.protected is not None:
            rule += f", {len(self.protected)} protected tokens"
        kinds = sorted(set(self.map_kinds.values()))
        where = f"{self.origin}, pulled into {self.folder}" if self.origin else str(self.folder)
        return (f"release {where} (maps {self.sha256[:12]}, {self.model['name']}): split {self.split} of {L}, "
                f"tail {self.tail}, layers {self.split}..{L - 1} filled from {self.projector} {'/'.join(kinds)} maps; "
                f"exact rows: the first {self.anchor}, the tail, {rule}")  # fmt: skip


def setting() -> str | None:
    """RIDGEFILL_RELEASE, stripped; None when unset or empty (the engine runs untouched). A value of blanks alone is
    refused: it looks unset and is not, and serving stock without a word would hide the mistake."""
    value = os.environ.get(ENV)
    if value and not value.strip():
        raise BadInput(f"{ENV} is set to blanks ({value!r}): unset it to serve without the fill, or name {FORMS}")
    return (value or "").strip() or None


def locate(value: str) -> Path:
    """The local folder RIDGEFILL_RELEASE names, by the rule every command has (`hub.releases.locate_release`):
    `hf://owner/name[@rev]` pulled into the release cache (or found there), anything else a folder as it is, a
    missing one refused. BadInput / RidgefillError in one line, starting `RIDGEFILL_RELEASE=value:`."""
    path = locate_release(value, where=f"{ENV}={value}")
    return path if value.startswith(HUB) else path.resolve()


def load(folder: Path) -> Fill:
    """Read and verify the release in `folder` and check that an engine can apply it row by row: full attention
    above the split, a configuration decided per row (the plain fill or ridgefill+protected). Every fact is the
    reader's (`Release`: split, tail, anchor, exact-row norm, map kinds, widths), checked there once."""
    rel = read_release(folder)
    m = rel.manifest
    where = f"{ENV}={folder}"
    kinds = sorted({layer["kind"] for layer in m["layers"]} - {FULL, "attention"})
    if kinds:
        raise BadInput(f"{where}: layers of kind {kinds} above the split; the engine fills attention layers only")
    conf = rel.configuration["arm"]
    if conf not in CAUSAL:
        raise BadInput(f"{where}: configuration {conf} needs the whole prompt's tail before any row is filled (a "
                       f"serving engine fills a prompt chunk by chunk); export the release as {PLAIN}")
    maps = {l: (t["weight"], t["bias"]) for l, t in sorted(rel.maps.items())}  # widths checked by the reader
    protected = None if conf != PROTECTED_CONFIGURATION else rel.protected.astype(np.int64)
    return Fill(folder=Path(folder), manifest=m, sha256=m["files"][MAPS_FILE], split=rel.split, tail=rel.tail,
                anchor=rel.anchor, exact_norm=rel.exact_norm, configuration=conf, protected=protected, maps=maps,
                map_kinds=dict(rel.map_kinds))  # fmt: skip


def from_environment() -> Fill | None:
    """The release RIDGEFILL_RELEASE names, loaded (`locate`, `load`), or None when it is unset or empty."""
    value = setting()
    if value is None:
        return None
    fill = load(locate(value))
    return replace(fill, origin=value) if value.startswith(HUB) else fill


def check_model(fill: Fill, config: dict, path: str | Path | None = None) -> None:
    """BadInput naming the first way the served model is not the release's: its architecture (one the engine
    fills), layer count and hidden size from its config, or a protected-token table past its vocabulary
    (`vocab_size`), each compared where the config states it, then, when `path` is a local model folder (or a
    cached Hub snapshot), its fingerprint (`identity.served_fingerprint_problem`). The tail is checked against the
    context the engine serves (the plugin's `max_model_len` check), not the config's `max_position_embeddings`,
    which rope scaling lets a server exceed."""
    from ridgefill.engines import identity

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise BadInput(f"{ENV}: the served model is '{model_type}'; the fill runs in {sorted(ARCHITECTURES)} models")
    problem = identity.served_config_problem(config, fill.manifest)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = integer(text.get("vocab_size"))
    if problem is None and vocab is not None and fill.protected is not None and len(fill.protected):
        problem = protected_problem(int(fill.protected[-1]), vocab, "the served model")  # ascending: last is largest
    if problem is None and path is not None and Path(path).is_dir():
        problem = identity.served_fingerprint_problem(Path(path), fill.manifest)
    if problem:
        raise BadInput(f"{ENV}={fill.folder}: {problem}")
