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
                                            # max_needle_drop, max_key_dnll, ...); tail defaults to [export]'s
    [quantize]                              # enabled = true (false: release the float maps)
    [export]                                # tail
    [eval]                                  # enabled, gate (a gate file) and EvalConfig fields
    [push]                                  # repo (required to push), revision, private, commit_message

capture -> solve -> quantize -> export -> eval (gate) -> push (only with `--push`). With `split = "auto"` a sweep
comes first: it captures every split it measures in one pass, solves and quantizes each, and the release is its
recommended split (a cache hit for capture, solve and quantize); no split within the budget stops the run (exit 3).
Every stage is the same function the single commands call, so each is a cache hit when its recipe did not change: a
re-run with nothing changed loads no model; changing the alpha grid re-runs solve and the stages after it, not
capture. The gate failing stops the run before push (exit 3). The top-level device / dtype / device_map /
max_memory are resolved once into one placement, given to solve, quantize and eval, and to capture unless its own
table sets them (then its own).
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.formats.release.names import tail_problem
from ridgefill.output import Output

SECTIONS = {"capture", "solve", "quantize", "export", "eval", "push", "sweep"}
PLACE_KEYS = ("device", "dtype", "device_map", "max_memory")  # optional top-level keys: where the model runs
PLACE_KINDS = {"device": "string", "dtype": "string", "device_map": "string", "max_memory": "table | list of string"}
SOLVE_KINDS = {"alphas": "list of number", "metric": "string", "maps": "string", "split": 'integer | "auto"',
               "chat_share": "number", "alpha_per_layer": "boolean", "state_data": "string | list of string",
               "state_chunk": "integer"}
PUSH_KEYS = {"repo", "revision", "private", "commit_message"}
PUSH_KINDS = {"repo": "string", "revision": "string", "private": "boolean", "commit_message": "string"}


@dataclass
class Recipe:
    path: Path
    model: str
    out: Path
    capture: dict
    solve: dict
    quantize: bool
    tail: int | None
    eval: dict | None  # None: no eval
    gate: Path | None
    push: dict | None
    place: dict = field(default_factory=dict)  # the top-level PLACE_KEYS given
    sweep: dict | None = None  # SweepConfig fields, when [solve] split = "auto"


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
    import typing

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


def load_recipe(path: Path) -> Recipe:
    """Parse and check a recipe file; BadInput names the first problem."""
    from ridgefill.capture.config import DEFAULT_DATA, CaptureConfig
    from ridgefill.evaluate import EvalConfig

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
    cap = dict(_known(doc.get("capture", {}), {f.name for f in fields(CaptureConfig)} | {"data", *PLACE_KEYS},
                      "capture"))
    _typed(cap, {**_kinds_of(CaptureConfig), "data": "string | list of string", **PLACE_KINDS}, "capture")
    cap.setdefault("data", list(DEFAULT_DATA))
    if isinstance(cap["data"], str):
        cap["data"] = [cap["data"]]
    cap["data"] = [d if d.startswith("builtin:") else str(rel(d)) for d in cap["data"]]
    ev = doc.get("eval", {})
    _known(ev, {f.name for f in fields(EvalConfig)} | {"enabled", "gate"}, "eval")
    _typed(ev, {**_kinds_of(EvalConfig), "enabled": "boolean", "gate": "string"}, "eval")
    quant = _typed(_known(doc.get("quantize", {}), {"enabled"}, "quantize"), {"enabled": "boolean"}, "quantize")
    exp = _typed(_known(doc.get("export", {}), {"tail"}, "export"), {"tail": "integer"}, "export")
    if "tail" in exp and tail_problem(exp["tail"]) is not None:  # export's own bound, before any stage runs
        raise BadInput(f"recipe [export]: tail {tail_problem(exp['tail'])}")
    push = _typed(_known(doc["push"], PUSH_KEYS, "push"), PUSH_KINDS, "push") if "push" in doc else None
    sol = dict(_typed(_known(doc.get("solve", {}), set(SOLVE_KINDS), "solve"), SOLVE_KINDS, "solve"))
    if "state_data" in sol:
        paths = [sol["state_data"]] if isinstance(sol["state_data"], str) else sol["state_data"]
        if not paths:
            raise BadInput("recipe [solve]: state_data must be a path or a list of paths, got an empty array")
        sol["state_data"] = [str(rel(x)) for x in paths]
    if "maps" in sol:
        from ridgefill.solve.config import MAP_CHOICES

        if sol["maps"] not in MAP_CHOICES:
            raise BadInput(f"recipe [solve]: maps must be one of {', '.join(MAP_CHOICES)}, got {sol['maps']!r}")
    sweep = None
    if sol.get("split") == "auto":
        from ridgefill.sweep import RECIPE_KEYS, SweepConfig, check_config, renamed

        # quantize and alpha_per_layer come from [quantize] and [solve], as for the release itself
        keys = {f.name for f in fields(SweepConfig)} - {"quantize", "alpha_per_layer"}
        table = doc.get("sweep", {})
        if isinstance(table, dict):  # an old key name: its new one, with a warning (or refused beside it)
            table = renamed(table, RECIPE_KEYS, Output())
        sweep = dict(_typed(_known(table, keys, "sweep"), _kinds_of(SweepConfig), "sweep"))
        if sweep.get("splits") == []:  # SweepConfig's empty splits mean its defaults: say so, do not guess
            raise BadInput("recipe [sweep]: splits is an empty array: name at least one split, or leave splits out "
                           "for the default ones")
        if "splits" in cap:
            raise BadInput("recipe: [capture] splits and [solve] split = \"auto\" conflict: the sweep captures the "
                           "splits it measures (set them in [sweep] splits)")
        if "tail" in exp:
            sweep.setdefault("tail", exp["tail"])
        # every value checked now, by its key in the recipe, not after a capture and by a flag nobody typed
        check_config(SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in sweep.items()}),
                     RECIPE_KEYS)
    elif "sweep" in doc:
        raise BadInput("recipe: a [sweep] table is used only with [solve] split = \"auto\"")
    elif "split" in sol:  # the split to release must be one the capture makes: checked now, not after a capture
        if "splits" not in cap:
            cap["splits"] = [sol["split"]]
        elif sol["split"] not in cap["splits"]:
            raise BadInput(f"recipe: [solve] split = {sol['split']} is not one of [capture] splits = "
                           f"{cap['splits']}")
    if push is not None and not isinstance(push.get("repo"), str):
        raise BadInput("recipe [push]: 'repo' (OWNER/NAME) is required")
    return Recipe(path=path, model=doc["model"], out=rel(doc.get("out", f"release/{name}")), capture=cap,
                  solve=sol, quantize=bool(quant.get("enabled", True)),
                  tail=exp.get("tail"), eval=None if not ev.get("enabled", True) else
                  {k: v for k, v in ev.items() if k not in ("enabled", "gate")},
                  gate=rel(ev["gate"]) if ev.get("gate") and ev.get("enabled", True) else None, push=push,
                  place=place, sweep=sweep)  # fmt: skip


def run_recipe(recipe: Recipe, store, out: Output, push: bool = False, token: str | None = None) -> dict:
    """Run every stage; returns the JSON summary (a failed gate: summary["gate"]["passed"] is False, no push)."""
    from ridgefill.capture import CaptureConfig, capture
    from ridgefill.evaluate.gate import load_gate
    from ridgefill.evaluate import EvalConfig, check, evaluate, record
    from ridgefill.evaluate.summary import manifest_summary
    from ridgefill.export import export as export_release
    from ridgefill.quantize import quantize
    from ridgefill.formats.release import verify_release
    from ridgefill.solve import solve

    if push and recipe.push is None:
        raise BadInput(f"--push needs a [push] table with repo = \"OWNER/NAME\" in {recipe.path}")
    cfg = rules = None
    if recipe.eval is not None:  # the eval's settings and the gate are checked before any work
        cfg = EvalConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.eval.items()})
        rules = load_gate(recipe.gate, [a.name for a in check(cfg)]) if recipe.gate else None
    p = recipe.place
    # Resolved once (a bad device fails before any work), given to every stage that runs the model.
    w = _where(p)
    # capture runs where the rest does, unless its own table says otherwise
    cap_place = _where({**p, **{k: recipe.capture[k] for k in PLACE_KEYS if k in recipe.capture}})
    start = time.perf_counter()
    summary: dict = {"recipe": str(recipe.path), "model": recipe.model, "stages": {}}

    def stage(name, fn):
        t = time.perf_counter()
        out.info(f"[bold]{name}[/bold] ...")
        art, cached = fn()
        summary["stages"][name] = {"id": art.id, "cached": cached, "seconds": round(time.perf_counter() - t, 2)}
        out.info(f"[bold]{name}[/bold] {art.id} ({'cached' if cached else 'written'})")
        return art

    cap_cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in recipe.capture.items()
               if k != "data" and k not in PLACE_KEYS}
    solve_args = dict(recipe.solve)
    if recipe.sweep is not None:  # split = "auto": the sweep's capture and recommendation
        from ridgefill.errors import GateFailed
        from ridgefill.sweep import RECIPE_KEYS, SweepConfig, sweep

        scfg = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recipe.sweep.items()},
                           quantize=recipe.quantize, alpha_per_layer=solve_args.get("alpha_per_layer", False))
        # the sweep's solves measure no terminal-state offsets: the released split's solve does
        shared = {k: v for k, v in solve_args.items() if k not in ("split", "alpha_per_layer", "state_data",
                                                                     "state_chunk")}  # fmt: skip
        sw = stage("sweep", lambda: sweep(store, recipe.model, scfg, out, data=recipe.capture["data"],
                                          capture_args=cap_cfg, solve_args=shared, place=w, capture_place=cap_place,
                                          names=RECIPE_KEYS))
        rec = sw.manifest["summary"]
        summary["sweep"] = {"recommended": rec["recommended"], "configuration": rec["configuration"],
                            "tail": rec["tail"], "reason": rec["reason"], "splits": rec["splits"]}
        if rec["recommended"] is None:
            raise GateFailed(f"sweep {sw.id}: {rec['reason']}")
        solve_args["split"] = rec["recommended"]
        chosen = {"configuration": rec["configuration"], "sweep": sw.id}
        cap = stage("capture", lambda: (store.get(rec["capture"], stage="capture"), True))
    else:
        chosen = {}
        cap = stage("capture", lambda: capture(store, recipe.model, recipe.capture["data"], CaptureConfig(**cap_cfg), out,
                                               place=cap_place))
    sol = stage("solve", lambda: solve(store, cap.id, out, **solve_args, place=w))
    src = stage("quantize", lambda: quantize(store, sol.id, out, place=w)) if recipe.quantize else sol
    tail = {"tail": recipe.tail} if recipe.tail else {}
    if chosen:  # the sweep's (split, configuration), recorded with the sweep's id; a longer tail when it says so
        tail = {"tail": rec["tail"]} if rec["tail"] != (recipe.tail or scfg.tail) else tail

    def export():
        art, cached, _ = export_release(store, src.id, recipe.out, out, force=True, **tail, **chosen)
        return art, cached

    stage("export", export)
    verify_release(recipe.out)
    summary["release"] = str(recipe.out)
    failed: list[str] = []
    if recipe.eval is not None:
        ev = stage("eval", lambda: evaluate(store, recipe.model, str(recipe.out), cfg, out, place=w))
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
        summary["push"] = hub_push(recipe.out, p["repo"], revision=p.get("revision", "main"),
                                   private=bool(p.get("private", False)), commit_message=p.get("commit_message"),
                                   token=token, out=out)
        summary["stages"]["push"] = {"seconds": round(time.perf_counter() - t, 2)}
    summary["seconds"] = round(time.perf_counter() - start, 2)
    return summary


def _where(keys: dict):
    """The Where of a recipe's device, dtype, device_map and max_memory keys (BadInput, one line, for a bad one)."""
    from ridgefill.models.device import where

    memory = keys.get("max_memory")
    if isinstance(memory, dict):  # a table of DEVICE = SIZE, as the top level writes it
        memory = [f"{k}={v}" for k, v in memory.items()]
    return where(keys.get("device", "auto"), keys.get("dtype", "auto"), keys.get("device_map"), memory)
