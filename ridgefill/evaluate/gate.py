"""The release gate: thresholds from a TOML file, checked against an eval summary (exit 3 on failure).

    arm = "ridgefill"            # the arm the thresholds apply to (default: the release's configured arm, which is
                                 # ridgefill for a plain release, a solve or a quantize artifact)
    [thresholds]
    needle_drop_max = 5.0        # needle accuracy may be at most 5 points below exact
    dnll_key_max = 0.5           # mean ΔNLL on key tokens (nats)
    dnll_novel_max = 0.05        # mean ΔNLL on novel tokens
    dnll_max = 0.1               # mean ΔNLL on all scored tokens
    kl_max = 0.5                 # mean KL(exact || arm)
    top1_min = 0.8               # top-1 agreement with exact
"""

from __future__ import annotations

from pathlib import Path

from ridgefill.errors import BadInput

DEFAULT_ARM = "ridgefill"
# threshold name -> (summary key, "max" | "min", how the value is computed)
CHECKS = {
    "needle_drop_max": ("needle_drop", "max"),
    "dnll_key_max": ("dnll_key", "max"),
    "dnll_novel_max": ("dnll_novel", "max"),
    "dnll_max": ("dnll", "max"),
    "kl_max": ("kl", "max"),
    "top1_min": ("top1", "min"),
}


def gate_arm(gate: dict, default_arm: str = DEFAULT_ARM) -> str:
    """The arm a gate judges: its `arm`, else `default_arm` (the release's configured arm)."""
    return gate.get("arm", default_arm)


def load_gate(path: Path, arms=None, default_arm: str = DEFAULT_ARM) -> dict:
    """A gate file, checked: known keys, `arm` a string, every threshold a number; with `arms` (the names eval will
    measure) the gate's arm (`default_arm`, the release's configured arm, when the file names none) must be one of
    them. BadInput names the first problem, before any eval runs. The file's own keys are returned: a gate without
    `arm` judges the configured arm of whatever release it is checked against (`check_gate`)."""
    import tomllib

    try:
        gate = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"gate file '{path}' does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"gate file '{path}': {e}") from None
    thresholds = gate.get("thresholds", {})
    if not isinstance(thresholds, dict):
        raise BadInput(f"gate file '{path}': [thresholds] must be a table")
    unknown = set(gate) - {"arm", "thresholds"} | set(thresholds) - set(CHECKS)
    if unknown:
        raise BadInput(f"gate file '{path}': unknown key(s) {', '.join(sorted(unknown))} (known: arm, {', '.join(CHECKS)})")
    if not thresholds:
        raise BadInput(f"gate file '{path}' has no [thresholds]")
    for name, limit in sorted(thresholds.items()):
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit != limit:
            raise BadInput(f"gate file '{path}': {name} must be a number, got {limit!r}")
    arm = gate_arm(gate, default_arm)
    if not isinstance(arm, str):
        raise BadInput(f"gate file '{path}': arm must be an arm's name, got {arm!r}")
    if arms is not None and arm not in arms:
        why = "" if "arm" in gate or arm == DEFAULT_ARM else " (the release's configured arm: the file names no arm)"
        raise BadInput(f"gate file '{path}': arm '{arm}'{why} is not among the arms eval measures "
                       f"({', '.join(arms)}); add it with --arms (a recipe: [eval] arms)")
    return gate


def check_gate(summary: dict, gate: dict, default_arm: str = DEFAULT_ARM) -> list[str]:
    """The failed thresholds, each as one readable line; empty when the release passes. The gate's arm, or
    `default_arm` (the configured arm of the release evaluated) when it names none."""
    arm = gate_arm(gate, default_arm)
    if arm not in summary["arms"]:
        raise BadInput(f"gate arm '{arm}' was not evaluated (use --arms)")
    s = dict(summary["arms"][arm])
    if "needle" in s and "needle" in summary["arms"]["exact"]:
        s["needle_drop"] = summary["arms"]["exact"]["needle"] - s["needle"]
    failed = []
    for name, limit in sorted(gate["thresholds"].items()):
        key, kind = CHECKS[name]
        value = s.get(key)
        if value is None:
            failed.append(f"{name}: {arm} has no {key} figure")
        elif (kind == "max" and value > limit) or (kind == "min" and value < limit):
            failed.append(f"{name}: {arm} {key} = {value:.4g}, limit {limit:g}")
    return failed
