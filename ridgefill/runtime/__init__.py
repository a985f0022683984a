"""The fill runtime: prefill a prompt with a RidgeFill release (or without one, for comparison) and decode.

    from ridgefill.models import load_model, resolve_model
    from ridgefill.runtime import greedy, load_release_maps, prefill

    lm = load_model(resolve_model("builtin:smollm2-135m", store_root=store), store_root=store)
    rel = load_release_maps(lm, "release/smollm2-135m")
    res = prefill(lm, ids, "ridgefill", split=rel.split, tail=rel.tail, maps=rel.maps)
    tokens = greedy(lm, res, max_new=20)

The public API is `__all__` below; docs/runtime.md describes it, with a runnable example. Modules:
`prefill.py` (the arms, `prefill`, `ceiling`), `cache.py` (`SlotCache`, `greedy`, `greedy_batch`), `maps.py` (maps from a release
folder onto the model's devices), `layers.py` (calling the model's own decoder layers on chosen rows).

Importing this package imports torch; `import ridgefill` does not import this package.
"""

from ridgefill.runtime.cache import SlotCache, greedy, greedy_batch
from ridgefill.runtime.maps import ReleaseMaps, load_release_maps, maps_on_devices
from ridgefill.runtime.prefill import (ARMS, OUTLIER_RATIO, ExactRun, PrefillResult, ceiling, exact_run, outlier_rows,
                                      prefill, prefill_from)

__all__ = ["ARMS", "OUTLIER_RATIO", "ExactRun", "PrefillResult", "ReleaseMaps", "SlotCache", "ceiling", "exact_run", "greedy",
           "greedy_batch", "load_release_maps", "maps_on_devices", "outlier_rows", "prefill", "prefill_from"]  # fmt: skip
