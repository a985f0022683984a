"""The release a serving engine fills with (docs/engines.md, "Serving a release with vLLM"): named by
`RIDGEFILL_RELEASE`, read with the project's own release reader, and checked against the model the engine serves.

    from ridgefill.engines.vllm import served
    fill = served.from_environment()          # None when RIDGEFILL_RELEASE is unset or empty
    served.check_model(fill, config, path)    # BadInput naming the first mismatch
    served.PROCESS.remember(fill)             # the plugin: this process's release, its facts only
    served.PROCESS.for_model()                # the model being built: the release with its maps

`RIDGEFILL_RELEASE` is a release folder, or a Hub release written `hf://owner/name[@rev]`, pulled and verified as
`ridgefill pull` does into `$RIDGEFILL_CACHE/releases` (default `~/.cache/ridgefill/releases`;
`hub.releases.locate_release`, the rule every command that takes a release has) and reused from there. A value
without `hf://` is only ever a folder: a path that does not exist is refused, never looked up on the Hub
(`release/x` typed in the wrong folder is not someone's repo).
Imports: the standard library, numpy and ridgefill's numpy-only modules (no torch, no transformers), so the engine's
own environment reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ridgefill import environment
from ridgefill.errors import BadInput
from ridgefill.formats.release import MAPS_FILE, Release, read_release
from ridgefill.formats.release.names import PLAIN, PROTECTED_CONFIGURATION, integer
from ridgefill.hub.releases import FORMS, HUB, locate_release
from ridgefill.models.kinds import FULL

ENV = environment.RIDGEFILL_RELEASE
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CAUSAL = (PLAIN, PROTECTED_CONFIGURATION)  # configurations decided row by row; +rows and +kscale read the tail


@dataclass(frozen=True)
class Fill:
    """A verified release, as an engine applies it: the reader's `Release` (every fact, checked once) and where it
    came from. The facts are the release's `fill_options()`, the mapping every runtime applies it with."""

    folder: Path
    release: Release
    origin: str | None = None  # where it came from when not a folder given as such: "hf://owner/name@rev"

    manifest = property(lambda self: self.release.manifest)
    split = property(lambda self: self.release.split)
    tail = property(lambda self: self.release.tail)  # the release's `tail_default`
    anchor = property(lambda self: self.release.anchor)  # `fit.skip_first_rows`: leading rows that run exactly
    exact_norm = property(lambda self: self.release.exact_norm)  # prefix rows above this split-state norm: exact
    map_kinds = property(lambda self: dict(self.release.map_kinds))  # {layer: "input" | "kv"}
    configuration = property(lambda self: self.release.configuration["arm"])
    earlier = property(lambda self: self.release.states[1:])  # earlier layers whose inputs the maps read (/3)

    @property
    def sha256(self) -> str:
        """Of maps.safetensors, whose hash covers every fact: the release's identity."""
        return self.manifest["files"][MAPS_FILE]

    @property
    def protected(self) -> np.ndarray | None:
        """int64 token ids whose rows run exactly (a ridgefill+protected release's table), or None."""
        return self.release.fill_options().get("protected")

    @property
    def maps(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{layer: (W float32 [d_out, d], b float32 [d_out])}; empty once let go (`without_maps`)."""
        return {l: (t["weight"], t["bias"]) for l, t in sorted(self.release.maps.items())}

    def without_maps(self) -> Fill:
        """The same fill with the decoded maps let go: what a process keeps that does not build the model, and what
        the model keeps once it holds them as its own parameters."""
        return replace(self, release=self.release.without_maps())

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def projector(self) -> str:
        return self.manifest["projector"]["dtype"]

    def describe(self) -> str:
        """One line: what is on."""
        L = self.model["num_layers"]
        reads = f"the states entering layers {self.split}, {', '.join(map(str, self.earlier))}" if self.earlier \
            else "the split state"
        rule = f"{reads} above norm {self.exact_norm:.4g}"
        if self.protected is not None:
            rule += f", {len(self.protected)} protected tokens"
        kinds = sorted(set(self.map_kinds.values()))
        where = f"{self.origin}, pulled into {self.folder}" if self.origin else str(self.folder)
        return (f"release {where} (maps {self.sha256[:12]}, {self.model['name']}): split {self.split} of {L}, "
                f"tail {self.tail}, layers {self.split}..{L - 1} filled from {self.projector} {'/'.join(kinds)} maps; "
                f"exact rows: the first {self.anchor}, the tail, {rule}")  # fmt: skip


class Process:
    """The release this process serves: what `plugin.register` verified (every vLLM process runs it: the API server,
    the engine core, each rank), kept as its facts without its maps, and handed to the model being built with its
    maps read again. One object, here rather than in the plugin, so that the model it builds imports no plugin."""

    def __init__(self) -> None:
        self.fill: Fill | None = None

    def remember(self, fill: Fill) -> None:
        """Keep `fill`'s facts; its maps are let go (only a process that builds the model needs them, and a 70B's
        float32 input maps are 10.7 GB)."""
        self.fill = fill.without_maps()

    def for_model(self) -> Fill:
        """The release with its maps, for the model being built: the folder `register` verified, read again (the
        model lets the maps go once they are its parameters); read from RIDGEFILL_RELEASE where `register` did not
        run."""
        if self.fill is None:
            return from_environment()
        return replace(load(self.fill.folder), origin=self.fill.origin)


PROCESS = Process()


def setting() -> str | None:
    """RIDGEFILL_RELEASE as it is; None when unset or empty (the engine runs untouched). A value of blanks alone is
    refused: it looks unset and is not, and serving stock without a word would hide the mistake."""
    value = environment.raw(ENV)
    if value and not value.strip():
        raise BadInput(f"{ENV} is set to blanks ({value!r}): unset it to serve without the fill, or name {FORMS}")
    return value or None  # blanks around a name are the shared rule's to refuse (`hub.releases.locate_release`)


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
    return Fill(folder=Path(folder), release=rel)


def from_environment() -> Fill | None:
    """The release RIDGEFILL_RELEASE names, loaded (`locate`, `load`), or None when it is unset or empty."""
    value = setting()
    if value is None:
        return None
    fill = load(locate(value))
    return replace(fill, origin=value) if value.startswith(HUB) else fill


def check_model(fill: Fill, config: dict, path: str | Path | None = None, dtype: str | None = None) -> None:
    """BadInput naming the first way the served model is not the release's: its architecture (one the engine
    fills), then the served config against the release's facts (`identity.served_config_problem`: architecture,
    layer count, hidden size, KV heads and head size), then the check every runtime makes (`Release.check_model`:
    the maps cover the late layers with the model's widths, a protected-token table within its `vocab_size`, the
    maps within the range of the dtype it computes in), each compared where the config states it, then, when `path`
    is a local model folder (or a cached Hub snapshot), its fingerprint (`identity.served_fingerprint_problem`). The
    tail is checked against the context the engine serves (the plugin's `max_model_len` check), not the config's
    `max_position_embeddings`, which rope scaling lets a server exceed."""
    from ridgefill.engines import identity

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise BadInput(f"{ENV}: the served model is '{model_type}'; the fill runs in {sorted(ARCHITECTURES)} models")
    where = f"{ENV}={fill.folder}"
    problem = identity.served_config_problem(config, fill.manifest)
    if problem:
        raise BadInput(f"{where}: {problem}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden, heads = integer(text.get("hidden_size")), integer(text.get("num_attention_heads"))
    kv_heads = integer(text.get("num_key_value_heads")) or heads
    head_dim = integer(text.get("head_dim")) or (hidden // heads if hidden and heads else None)
    fill.release.check_model(fingerprint=None, num_layers=integer(text.get("num_hidden_layers")), hidden_size=hidden,
                             num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=integer(text.get("vocab_size")),
                             name="the served model", where=where, dtype=dtype)
    if path is not None and Path(path).is_dir():
        problem = identity.served_fingerprint_problem(Path(path), fill.manifest)
        if problem:
            raise BadInput(f"{where}: {problem}")
