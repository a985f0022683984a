"""The sweep's settings (`SweepConfig`) and their checks, by the name the user gave each one: the command's flags
or a recipe's [sweep] keys (`Names`, `renamed`); what the artifact records of them (`recorded`); and `Setup`, what
every phase of a measurement reads. Light: the CLI and the recipe reader import it without torch or numpy.

    cfg = SweepConfig(splits="8-24:2", needles=40)
    check_config(cfg)                          # BadInput names the first problem, before anything is resolved
    splits = check_splits(cfg, num_layers)     # once the model is known
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.runtime.rows import DEFAULT_TAIL

DEFAULT_SPLITS = 8  # evenly spaced over the middle half of the layers
LONG_LENGTH = 16384  # the long needle prompts' length, where the model's context holds it (SweepConfig.long_length)
# Settings renamed since the sweep's format was fixed, {old name: new name}: the old name is still taken, with a
# warning, until the release after 0.1 (`renamed`). The artifact's recipe and sweep.json keep the old key (`recorded`),
# so that no sweep id changes with the name.
RENAMED = {"samples": "needles"}


@dataclass(frozen=True)
class SweepConfig:
    splits: tuple[int, ...] | str = ()  # empty: DEFAULT_SPLITS evenly spaced over layers L/4 .. 3L/4; or --splits text
    length: int = 4096
    long_length: int | None = None  # None: LONG_LENGTH where the model's context holds it; 0: no long prompts
    tail: int = DEFAULT_TAIL
    needles: int = 48  # needle prompts in all, at most: whole rounds of the mix (`needles.Mix`), rounded up
    documents: int = 4
    scored: int = 256
    max_needle_drop: float = 10.0  # points below exact
    max_key_dnll: float = 0.5  # nats
    gate: tuple[tuple[str, float], ...] = ()  # a release gate's thresholds ((name, limit), ...): also the budget
    quantize: bool = True  # measure the int8 maps a release ships (False: the float maps)
    alpha_per_layer: bool = False
    seed: int = 0
    bootstrap: int = 10000
    exhaustive: bool = False  # every split and arm on every prompt (no bisection, no sequential rule)
    configurations: bool = True  # measure +rows, +kscale, +protected beside their controls near the edge
    repeats: int = 3  # timing rounds


@dataclass(frozen=True)
class Setup:
    """What every phase of one sweep's measurement reads, fixed once the model is loaded: the model (a
    `models.load.LoadedModel`), the settings (splits resolved), each split's maps as eval loads them ({split:
    `evaluate.source.MapsSource`}), the calibration documents' hashes (no evaluation text may be one), where
    progress goes, and the build's work folder (the resumable records and the early layers kept)."""

    lm: object
    cfg: SweepConfig
    sources: dict
    calib: object
    out: object
    work: Path

    @property
    def splits(self) -> list[int]:
        return sorted(self.sources)

    @property
    def layers(self) -> int:
        return self.lm.adapter.num_layers


def recorded(cfg: SweepConfig) -> dict:
    """The settings as the sweep artifact's recipe records them: lists for tuples, and a renamed setting under its
    old name (RENAMED), so that its ids stay those of the sweeps made before."""
    old = {new: was for was, new in RENAMED.items()}
    return {old.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}


@dataclass(frozen=True)
class Names:
    """How the user named the sweep's settings, for messages: the command's flags (`--max-needle-drop`), or a
    recipe's [sweep] keys (`recipe [sweep]: max_needle_drop`)."""

    prefix: str = ""  # before the whole message
    flags: bool = True

    def __call__(self, key: str) -> str:
        return "--" + key.replace("_", "-") if self.flags else key


FLAGS = Names()
RECIPE_KEYS = Names("recipe [sweep]: ", flags=False)


def renamed(given: dict, names: Names, out) -> dict:
    """`given` ({setting: value}, only those the user set) with each old name (RENAMED) replaced by its new one,
    and one warning line per old name on `out` (an Output). BadInput when a setting is given by both names."""
    from rich.markup import escape

    given = dict(given)
    for old, new in RENAMED.items():
        if old not in given:
            continue
        if new in given:
            raise BadInput(f"{names.prefix}{names(old)} and {names(new)} are the same setting; give only "
                           f"{names(new)} ({names(old)} is its old name)")
        out.warn(escape(f"{names.prefix}{names(old)} is deprecated: it is now {names(new)} (the same number); "
                        "the old name goes in the next release"))
        given[new] = given.pop(old)
    return given


def split_ranges(text: str, names: Names = FLAGS) -> list[tuple[int, int, int]]:
    """'8-24' (a range), '8-24:2' (a range with a step), '8,12,16' or a mix ('8-12,16') -> [(first, last, step)],
    checked but not expanded; BadInput for what is not one, a split 0 (never one: the fill needs an early layer),
    a step below 1 or an empty range."""
    at = f"{names.prefix}{names('splits')}"
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise BadInput(f"{at}: '{part}' is not a split, a range A-B or A-B:STEP (e.g. 8-24, 8-24:2, 8,12,16)")
        a, b, step = int(m[1]), int(m[2] or m[1]), int(m[3] or 1)
        if step < 1:
            raise BadInput(f"{at}: the step in '{part}' must be at least 1")
        if b < a:
            raise BadInput(f"{at}: the range '{part}' is empty")
        if a < 1:
            raise BadInput(f"{at}: '{part}' starts at split 0; a split is a layer 1 or deeper")
        out.append((a, b, step))
    return out


def parse_splits(text: str, num_layers: int, names: Names = FLAGS) -> tuple[int, ...]:
    """The splits `text` names (`split_ranges`) for a model of `num_layers` layers: every range is checked against
    the model before it is expanded, so a range past the last layer is one short refusal, whatever its length."""
    ranges = split_ranges(text, names)
    for a, b, step in ranges:
        if b >= num_layers:
            part = f"{a}-{b}" + (f":{step}" if step != 1 else "") if a != b else str(a)
            raise BadInput(f"{names.prefix}{names('splits')}: '{part}' reaches past the model's last split "
                           f"{num_layers - 1} (the model has {num_layers} layers; use 1..{num_layers - 1})")
    return tuple(sorted({s for a, b, step in ranges for s in range(a, b + 1, step)}))


def default_splits(num_layers: int) -> tuple[int, ...]:
    import numpy as np

    return tuple(sorted({int(x) for x in np.round(np.linspace(num_layers / 4, 3 * num_layers / 4, DEFAULT_SPLITS))}))


def check_splits(cfg: SweepConfig, num_layers: int, names: Names = FLAGS) -> tuple[int, ...]:
    """The splits to measure for a model of `num_layers` layers: `cfg.splits` (a list, or the --splits text), or
    DEFAULT_SPLITS of them. BadInput names the first problem."""
    if isinstance(cfg.splits, str):
        return parse_splits(cfg.splits, num_layers, names)
    splits = tuple(sorted(set(cfg.splits))) if cfg.splits else default_splits(num_layers)
    bad = [s for s in splits if not 0 < s < num_layers]
    if bad:
        raise BadInput(f"{names.prefix}split(s) {', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''} out of "
                       f"range: the model has {num_layers} layers (use 1..{num_layers - 1})")
    return splits


def check_context(cfg: SweepConfig, context: int | None, names: Names = FLAGS) -> None:
    """Refuse prompts longer than the model's context (`context` positions; None: the model states none)."""
    for name in ("length", "long_length"):
        n = getattr(cfg, name)
        if context and n and n > context:
            raise BadInput(f"{names.prefix}{names(name)} {n} is longer than the model's context ({context} "
                           "positions)")


def long_length(cfg: SweepConfig, context: int | None) -> int:
    """The long needle prompts' length (0: none): `cfg.long_length` as given, or by default LONG_LENGTH where the
    model's context (None: it states none) holds it and it is longer than `cfg.length`."""
    n = cfg.long_length
    if n is None:
        n = LONG_LENGTH if context and context >= LONG_LENGTH else 0
    return n if n > cfg.length else 0


# The budget's figures in words (`budget`'s keys): the over reasons and the budget's text name them so.
FIGURES = {"needle_drop": "needle drop", "dnll": "ΔNLL", "dnll_novel": "novel ΔNLL", "dnll_key": "key ΔNLL", "kl": "KL",
           "top1": "top-1"}


def budget(cfg: SweepConfig) -> dict:
    """The sweep's budget as {figure: ("max" | "min", limit)}: the needle drop in points ("needle_drop") and the
    documents' figures (evaluate.gate.CHECKS's summary keys). A gate's threshold joins it, or tightens the sweep's
    own limit on the same figure, so that nothing the sweep recommends fails a gate it was given on the figures
    both measure."""
    from ridgefill.evaluate.gate import CHECKS

    out = {"needle_drop": ("max", float(cfg.max_needle_drop)), "dnll_key": ("max", float(cfg.max_key_dnll))}
    for name, limit in cfg.gate:
        key, kind = CHECKS[name]
        if key in out:
            limit = min(out[key][1], limit) if kind == "max" else max(out[key][1], limit)
        out[key] = (kind, float(limit))
    return out


def check_config(cfg: SweepConfig, names: Names = FLAGS) -> None:
    """What can be checked without the model; BadInput names the first problem (before anything is resolved), by
    the name the user gave it (`names`: the command's flags, or a recipe's [sweep] keys)."""
    at = names.prefix
    if isinstance(cfg.splits, str):
        split_ranges(cfg.splits, names)
    else:
        bad = [s for s in cfg.splits if s < 1]
        if bad:
            raise BadInput(f"{at}{names('splits')}: {bad[0]} is not a split; a split is a layer 1 or deeper")
    for name in ("max_needle_drop", "max_key_dnll"):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise BadInput(f"{at}{names(name)} must be a number >= 0 (got {v})")
    if cfg.long_length is not None and (not isinstance(cfg.long_length, int) or cfg.long_length < 0):
        raise BadInput(f"{at}{names('long_length')} must be a length in tokens, or 0 for none (got {cfg.long_length})")
    from ridgefill.evaluate.gate import CHECKS

    for item in cfg.gate:
        name, limit = item if isinstance(item, tuple) and len(item) == 2 else (item, None)
        if name not in CHECKS or isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit != limit:
            raise BadInput(f"{at}gate: {name!r} = {limit!r} is not a threshold (known: {', '.join(CHECKS)})")
    if not 0 < cfg.scored < cfg.tail:
        raise BadInput(f"{at}need 0 < {names('scored')} ({cfg.scored}) < {names('tail')} ({cfg.tail})")
    if cfg.length <= cfg.tail:
        raise BadInput(f"{at}{names('length')} ({cfg.length}) must be longer than {names('tail')} ({cfg.tail}): the "
                       "fill skips the rows before the tail")
    for name in ("needles", "documents", "bootstrap"):  # a budget measured on nothing would pass anything
        if getattr(cfg, name) < 1:
            raise BadInput(f"{at}{names(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.repeats < 3:
        raise BadInput(f"{at}{names('repeats')} must be at least 3 (a median and an interval need three timings), got "
                       f"{cfg.repeats}")
    if cfg.seed < 0:
        raise BadInput(f"{at}{names('seed')} must be at least 0 (numpy's generators take no negative seed), got "
                       f"{cfg.seed}")
