"""The fill runtime: prefill a prompt with a RidgeFill release (or without one, for comparison) and decode.

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import greedy, load_release_maps, prefill

    lm = load_model(resolve_model("builtin:smollm2-135m", store_root=store), store_root=store)
    rel = load_release_maps(lm, "release/smollm2-135m")
    res = prefill(lm, ids, rel.arm, **rel.options())   # the release as made (its configuration too)
    tokens = greedy(lm, res, max_new=20)

The public API is `__all__` below; docs/runtime.md describes it, with a runnable example. Modules: `api.py`
(the arms, their options, `prefill`, `exact_run`, `prefill_from`, `ceiling`, `ceiling_speedup`), `fill.py` (the
fill itself), `rows.py` (which rows run exactly), `corrections.py`, `cache.py` (`SlotCache`, `greedy`,
`greedy_batch`, cache copies), `maps.py` (maps from a release folder onto the model's devices), `layers.py`
(calling the model's own decoder layers on chosen rows).

Names are loaded on first use (PEP 562): `import ridgefill.runtime` is cheap, and torch is imported with the first
name that needs it (`ridgefill.runtime.rows` never does).
"""

from ridgefill.lazy import exports

__getattr__, __all__ = exports(__name__, {
    "ARMS": "api", "ExactRun": "api", "FillOptions": "api", "PrefillResult": "api", "ceiling": "api",
    "ceiling_speedup": "api",
    "exact_run": "api", "fill_rows": "api", "prefill": "api", "prefill_from": "api", "prefix_prefill": "api",
    "selects_from": "api",
    "OUTLIER_RATIO": "rows", "norm_rows": "rows",
    "SlotCache": "cache", "greedy": "cache", "greedy_batch": "cache",
    "ReleaseMaps": "maps", "load_release_maps": "maps", "maps_on_devices": "maps",
})  # fmt: skip
