"""`ridgefill release RECIPE.toml`: the whole chain from one file, for CI.

    model = "builtin:smollm2-135m"          # required
    out = "release/smollm2-135m"            # release folder (relative paths: to the recipe file)
    device = "auto"                         # optional, for every stage that runs the model: auto | cpu | cuda[:N]
    dtype = "auto"                          # optional model dtype: auto | float32 | bfloat16 | float16
    device_map = "auto"                     # optional: spread a model too big for one device (accelerate)
    max_memory = { 0 = "20GiB", cpu = "64GiB" }   # optional, with device_map

    [capture]                               # CaptureConfig fields; data defaults to ["builtin:default"]; device,
                                            # dtype, device_map, max_memory to capture elsewhere than the rest
    data = ["builtin:default"]
    [solve]                                 # maps, alphas, metric, split, chat_share, alpha_per_layer, and on a hybrid
                                            # state_data (paths, as capture's data) and state_chunk
    split = "auto"                          # optional: run `ridgefill sweep` and release its recommended split
    [sweep]                                 # with split = "auto": SweepConfig fields (splits, length, needles,
                                            # max_needle_drop, max_key_dnll, ...); tail defaults to [export]'s,
                                            # and [eval]'s gate joins the sweep's budget
    [quantize]                              # enabled = true (false: release the float maps)
    [export]                                # tail
    [eval]                                  # enabled, gate (a gate file) and EvalConfig fields
    [push]                                  # repo (required to push), revision, private, commit_message

Each table becomes its stage's config (`stage_config`: CaptureConfig, SolveConfig, ExportConfig, EvalConfig,
SweepConfig, `Push`), every value checked by its key when the file is read, before any stage runs; `Recipe` is the
tree of them. capture -> solve -> quantize -> export -> eval (gate) -> push (only with `--push`). With
`split = "auto"` a sweep comes first: it captures every split it measures in one pass, solves and quantizes each,
and the release is its recommended split at the tail it was measured with (a cache hit for capture, solve and
quantize); no split within the budget stops the run (exit 3). Every stage is the same function the single commands
call, so each is a cache hit when its recipe did not change: a re-run with nothing changed loads no model;
changing the alpha grid re-runs solve and the stages after it, not capture. The gate failing stops the run before
push (exit 3). The top-level device / dtype / device_map / max_memory are resolved once into one placement, given to
solve, quantize and eval, and to capture unless its own table sets them (then its own).
"""

from __future__ import annotations

import time
import tomllib
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ridgefill.capture.config import DEFAULT_DATA, CaptureConfig, check_config as check_capture
from ridgefill.errors import BadInput
from ridgefill.evaluate.config import EvalConfig
from ridgefill.export.config import ExportConfig
from ridgefill.formats.release.names import tail_problem
from ridgefill.output import Output
from ridgefill.solve.config import SolveConfig, check_config as check_solve
from ridgefill.sweep.config import RECIPE_KEYS, SweepConfig, check_config as check_sweep, renamed

SECTIONS = {"capture", "solve", "quantize", "export", "eval", "push", "sweep"}
PLACE_KEYS = ("device", "dtype", "device_map", "max_memory")  # optional top-level keys: where the model runs
PLACE_KINDS = {"device": "string", "dtype": "string", "device_map": "string", "max_memory": "table | list of string"}


@dataclass(frozen=True)
class Push:
    """A recipe's [push] table: where `--push` sends the release (hub.releases.push)."""

    repo: str | None = None  # OWNER/NAME, required
    revision: str = "main"
    private: bool = False
    commit_message: str | None = None


@dataclass(frozen=True)
class Recipe:
    """A recipe file, checked: one stage config per table, paths resolved against the file's folder."""

    path: Path
    model: str
    out: Path
    data: tuple[str, ...]  # [capture] data: builtin specs, or paths
    capture: CaptureConfig
    solve: SolveConfig  # split None with a sweep: the sweep's recommendation
    quantize: bool
    export: ExportConfig
    eval: EvalConfig | None  # None: no eval
    gate: Path | None
    push: Push | None
    place: dict = field(default_factory=dict)  # the top-level PLACE_KEYS given
    capture_place: dict = field(default_factory=dict)  # [capture]'s own PLACE_KEYS, over the top level's
    sweep: SweepConfig | None = None  # [solve] split = "auto": the sweep that picks the split


def _known(table: dict, allowed: set, where: str) -> dict:
    if not isinstance(table, dict):
        raise BadInput(f"recipe [{where}] must be a table, got {_toml_type(table)}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BadInput(f"recipe [{where}]: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})")
    return table


# What a key may hold, in TOML's words: one of these names, or "list of <name>", or a union with "|".
_TOML = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
         "table": lambda v: isinstance(v, dict)}


def _toml_type(v) -> str:
    for name in ("boolean", "integer", "string", "table"):
        if _TOML[name](v):
            return f"{name} {v!r}" if name != "table" else "a table"
    if isinstance(v, float):
        return f"number {v!r}"
    return f"an array {v!r}" if isinstance(v, list) else repr(v)


def _matches(v, kind: str) -> bool:
    for alt in kind.split(" | "):
        if alt.startswith("list of "):
            if isinstance(v, list) and all(_TOML[alt[8:]](x) for x in v):
                return True
        elif alt.startswith('"'):
            if v == alt.strip('"'):
                return True
        elif _TOML[alt](v):
            return True
    return False


def _typed(table: dict, kinds: dict[str, str], where: str) -> dict:
    """Refuse a value of the wrong TOML type (BadInput naming table, key and the type it must have)."""
    for key, value in table.items():
        kind = kinds.get(key)
        if kind is not None and not _matches(value, kind):
            raise BadInput(f"recipe [{where}]: {key} must be {_describe(kind)}, got {_toml_type(value)}")
    return table


def _describe(kind: str) -> str:
    """'integer | list of string' -> 'an integer or an array of strings'."""
    def one(alt: str) -> str:
        if alt.startswith("list of "):
            return f"an array of {alt[8:]}s"
        return alt if alt.startswith('"') else ("an " if alt[0] in "ai" else "a ") + alt

    return " or ".join(one(a) for a in kind.split(" | "))


def _kinds_of(config) -> dict[str, str]:
    """A config dataclass's fields as TOML kinds: int -> integer, float -> number, tuple[X, ...] -> list of X, a
    union -> its kinds joined (None left out: TOML has no null)."""
    names = {int: "integer", float: "number", bool: "boolean", str: "string"}

    def kind(hint) -> str | None:
        if hint in names:
            return names[hint]
        args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
        if typing.get_origin(hint) is tuple:
            return f"list of {names[args[0]]}" if args and args[0] in names else None
        kinds = [kind(a) for a in args]
        return " | ".join(kinds) if kinds and None not in kinds else None

    return {name: k for name, hint in typing.get_type_hints(config).items() if (k := kind(hint)) is not None}


def stage_config(cls, table, where: str, *, kinds: dict[str, str] | None = None, extra: dict[str, str] | None = None,
                 leave: frozenset[str] = frozenset()):
    """A recipe table as the stage config `cls` (a frozen dataclass) -> (config, {extra key: value}): the one place a
    TOML table becomes a config. BadInput for a table that is no table, a key that is neither a field of `cls`
    (less `leave`: the fields another table sets) nor one of `extra` ({key: TOML kind}), or a value of the wrong
    TOML type (a field's kind from its type hint unless `kinds` says otherwise). Arrays become tuples."""
    extra = extra or {}
    names = {f.name for f in fields(cls)} - leave
    _known(table, names | set(extra), where)
    _typed(table, {**_kinds_of(cls), **(kinds or {}), **extra}, where)
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items() if k in names}
    return cls(**given), {k: v for k, v in table.items() if k in extra}


def load_recipe(path: Path) -> Recipe:
    """Parse and check a recipe file: every table becomes its stage config, and every value is checked now, by its
    key in the recipe, before any stage runs; BadInput names the first problem."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"recipe '{path}' does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"recipe '{path}': {e}") from None
    _known(doc, SECTIONS | {"model", "out", *PLACE_KEYS}, "top level")
    if not isinstance(doc.get("model"), str):
        raise BadInput(f"recipe '{path}': 'model' (a model spec string) is required")
    _typed(doc, {"out": "string", **PLACE_KINDS}, "top level")
    place = {k: doc[k] for k in PLACE_KEYS if k in doc}
    base = path.resolve().parent
    rel = lambda p: (base / p).resolve()  # noqa: E731  (an absolute p stays itself)
    name = doc["model"].removeprefix("builtin:").replace("/", "--")
    capture, cap = stage_config(CaptureConfig, doc.get("capture", {}), "capture",
                                extra={"data": "string | list of string", **PLACE_KINDS})
    data = cap.pop("data", list(DEFAULT_DATA))
    data = tuple(d if d.startswith("builtin:") else str(rel(d)) for d in ([data] if isinstance(data, str) else data))
    evaluation, ev = stage_config(EvalConfig, doc.get("eval", {}), "eval",
                                  extra={"enabled": "boolean", "gate": "string"})
    quant = _typed(_known(doc.get("quantize", {}), {"enabled"}, "quantize"), {"enabled": "boolean"}, "quantize")
    export, _ = stage_config(ExportConfig, doc.get("export", {}), "export",
                             leave=frozenset({"configuration", "row_share", "sweep"}))  # set by the sweep
    if tail_problem(export.tail) is not None:  # export's own bound, before any stage runs
        raise BadInput(f"recipe [export]: tail {tail_problem(export.tail)}")
    push = stage_config(Push, doc["push"], "push")[0] if "push" in doc else None
    solve, sol = stage_config(SolveConfig, doc.get("solve", {}), "solve", leave=frozenset({"split"}),
                              kinds={"state_data": "string | list of string"}, extra={"split": 'integer | "auto"'})
    if isinstance(solve.state_data, str) or solve.state_data:
        paths = [solve.state_data] if isinstance(solve.state_data, str) else solve.state_data
        solve = replace(solve, state_data=tuple(str(rel(x)) for x in paths))
    elif "state_data" in doc.get("solve", {}):
        raise BadInput("recipe [solve]: state_data must be a path or a list of paths, got an empty array")
    check_capture(capture, "recipe [capture]: ", lambda key: key)
    check_solve(solve, "recipe [solve]: ", lambda key: key)
    quantize = quant.get("enabled", True)
    sweep = None
    if sol.get("split") == "auto":
        # quantize and alpha_per_layer come from [quantize] and [solve], as for the release itself
        table = doc.get("sweep", {})
        if isinstance(table, dict):  # an old key name: its new one, with a warning (or refused beside it)
            table = renamed(table, RECIPE_KEYS, Output())
        sweep, _ = stage_config(SweepConfig, table, "sweep", leave=frozenset({"quantize", "alpha_per_layer", "gate"}))
        if table.get("splits") == []:  # SweepConfig's empty splits mean its defaults: say so, do not guess
            raise BadInput("recipe [sweep]: splits is an empty array: name at least one split, or leave splits out "
                           "for the default ones")
        if capture.splits:
            raise BadInput("recipe: [capture] splits and [solve] split = \"auto\" conflict: the sweep captures the "
                           "splits it measures (set them in [sweep] splits)")
        tail = table.get("tail", export.tail)  # the sweep measures with the release's tail unless told otherwise
        sweep = replace(sweep, tail=tail, quantize=quantize, alpha_per_layer=solve.alpha_per_layer)
        # every value checked now, by its key in the recipe, not after a capture and by a flag nobody typed
        check_sweep(sweep, RECIPE_KEYS)
    elif "sweep" in doc:
        raise BadInput("recipe: a [sweep] table is used only with [solve] split = \"auto\"")
    elif "split" in sol:  # the split to release must be one the capture makes: checked now, not after a capture
        solve = replace(solve, split=sol["split"])
        if not capture.splits:
            capture = replace(capture, splits=(solve.split,))
        elif solve.split not in capture.splits:
            raise BadInput(f"recipe: [solve] split = {solve.split} is not one of [capture] splits = "
                           f"{list(capture.splits)}")
    if push is not None and not isinstance(push.repo, str):
        raise BadInput("recipe [push]: 'repo' (OWNER/NAME) is required")
    enabled = ev.get("enabled", True)
    return Recipe(path=path, model=doc["model"], out=rel(doc.get("out", f"release/{name}")), data=data,
                  capture=capture, solve=solve, quantize=quantize, export=export,
                  eval=evaluation if enabled else None, gate=rel(ev["gate"]) if ev.get("gate") and enabled else None,
                  push=push, place=place, capture_place=cap, sweep=sweep)


def run_recipe(recipe: Recipe, store, out: Output, push: bool = False, token: str | None = None) -> dict:
    """Run every stage; returns the JSON summary (a failed gate: summary["gate"]["passed"] is False, no push). The
    stages that run the model share one load of it where they run it alike (`models.load.kept_models`)."""
    from ridgefill.models.load import kept_models

    with kept_models():
        return _run_stages(recipe, store, out, push, token)


def _run_stages(recipe: Recipe, store, out: Output, push: bool, token: str | None) -> dict:
    from ridgefill.capture import capture
    from ridgefill.evaluate.gate import load_gate
    from ridgefill.evaluate import check, evaluate, record
    from ridgefill.evaluate.summary import manifest_summary
    from ridgefill.export import export as export_release
    from ridgefill.quantize import quantize
    from ridgefill.formats.release import verify_release
    from ridgefill.models.device import slow_dtype_warning
    from ridgefill.solve import solve

    if push and recipe.push is None:
        raise BadInput(f"--push needs a [push] table with repo = \"OWNER/NAME\" in {recipe.path}")
    rules = None
    if recipe.eval is not None:  # the eval's arms and the gate are checked before any work
        rules = load_gate(recipe.gate, [a.name for a in check(recipe.eval)]) if recipe.gate else None
    # Resolved once (a bad device fails before any work), given to every stage that runs the model.
    w = _where(recipe.place)
    # capture runs where the rest does, unless its own table says otherwise
    cap_place = _where({**recipe.place, **recipe.capture_place})
    for slow in dict.fromkeys(filter(None, map(slow_dtype_warning, (w, cap_place)))):
        out.warn(slow)
    start = time.perf_counter()
    summary: dict = {"recipe": str(recipe.path), "model": recipe.model, "stages": {}}

    def stage(name, fn):
        t = time.perf_counter()
        out.info(f"[bold]{name}[/bold] ...")
        art, cached = fn()
        summary["stages"][name] = {"id": art.id, "cached": cached, "seconds": round(time.perf_counter() - t, 2)}
        out.info(f"[bold]{name}[/bold] {art.id} ({'cached' if cached else 'written'})")
        return art

    solve_cfg, export_cfg = recipe.solve, recipe.export
    if recipe.sweep is not None:  # split = "auto": the sweep's capture and recommendation
        from ridgefill.errors import GateFailed
        from ridgefill.sweep import sweep

        # the sweep's solves measure no terminal-state offsets: the released split's solve does
        shared = {k: getattr(solve_cfg, k) for k in ("alphas", "metric", "maps", "chat_share", "earlier")}
        # the gate's thresholds are the sweep's budget too: it recommends nothing the gate would fail on them
        sweep_cfg = replace(recipe.sweep, gate=tuple(sorted(rules["thresholds"].items())) if rules else ())
        sw = stage("sweep", lambda: sweep(store, recipe.model, sweep_cfg, out, data=list(recipe.data),
                                          capture_args=asdict(recipe.capture), solve_args=shared, place=w,
                                          capture_place=cap_place, names=RECIPE_KEYS))
        rec = sw.manifest["summary"]
        summary["sweep"] = {"recommended": rec["recommended"], "configuration": rec["configuration"],
                            "tail": rec["tail"], "reason": rec["reason"], "splits": rec["splits"]}
        if rec["recommended"] is None:
            raise GateFailed(f"sweep {sw.id}: {rec['reason']}")
        solve_cfg, export_cfg = replace(solve_cfg, split=rec["recommended"]), recommended_export(export_cfg, sw)
        cap = stage("capture", lambda: (store.get(rec["capture"], stage="capture"), True))
    else:
        cap = stage("capture", lambda: capture(store, recipe.model, list(recipe.data), recipe.capture, out,
                                               place=cap_place))
    sol = stage("solve", lambda: solve(store, cap.id, solve_cfg, out, place=w))
    src = stage("quantize", lambda: quantize(store, sol.id, out, place=w)) if recipe.quantize else sol

    def export():
        art, cached, _ = export_release(store, src.id, export_cfg, out, out_dir=recipe.out, force=True)
        return art, cached

    stage("export", export)
    verify_release(recipe.out)
    summary["release"] = str(recipe.out)
    failed: list[str] = []
    if recipe.eval is not None:
        ev = stage("eval", lambda: evaluate(store, recipe.model, str(recipe.out), recipe.eval, out, place=w))
        gate = record(str(recipe.out), ev, rules, out)
        summary["eval"] = {"ceiling_speedup": ev.manifest["summary"]["ceiling_speedup"],
                           "arms": manifest_summary(ev.manifest["summary"], ev.id)["arms"]}
        if gate is not None:
            failed = gate["failed"]
            summary["gate"] = {"file": str(recipe.gate), **gate}
    if push and not failed:
        from ridgefill.hub.releases import push as hub_push

        p = recipe.push
        t = time.perf_counter()
        summary["push"] = hub_push(recipe.out, p.repo, revision=p.revision, private=p.private,
                                   commit_message=p.commit_message, token=token, out=out)
        summary["stages"]["push"] = {"seconds": round(time.perf_counter() - t, 2)}
    summary["seconds"] = round(time.perf_counter() - start, 2)
    return summary


def recommended_export(cfg: ExportConfig, sw) -> ExportConfig:
    """The export of what sweep artifact `sw` recommended: its configuration, recorded with the sweep's id, at the
    tail it measured the recommendation with (the sweep's own, or a longer one it found as good)."""
    rec = sw.manifest["summary"]
    return replace(cfg, tail=rec["tail"], configuration=rec["configuration"], sweep=sw.id)


def _where(keys: dict):
    """The Where of a recipe's device, dtype, device_map and max_memory keys (BadInput, one line, for a bad one)."""
    from ridgefill.models.device import where

    memory = keys.get("max_memory")
    if isinstance(memory, dict):  # a table of DEVICE = SIZE, as the top level writes it
        memory = [f"{k}={v}" for k, v in memory.items()]
    return where(keys.get("device", "auto"), keys.get("dtype", "auto"), keys.get("device_map"), memory)
