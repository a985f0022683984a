"""The decoded maps a vLLM process holds once the fill plugin has read a release (figure "release_memory").

    .venv/bin/python bench/release_memory.py [RELEASE] [--out FILE]      # default RELEASE: release/smollm2-135m

vLLM runs the plugin in every process it starts (the API server, the engine core, each tensor-parallel rank), and
each reads and verifies the release. Measured with tracemalloc, which sees numpy's allocations: the bytes held after
`served.load(RELEASE)` (the whole release as read: what every process held for as long as it ran, before the plugin
kept only the facts) and after `served.PROCESS.remember` of it with the read let go (what a process holds now, unless
it is building the model). Value: after / before. Also the float32 maps' size by the formula `4 (L - S) d_out (d+1)`.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, Bench, parser, release  # noqa: E402


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("release", type=release, nargs="?", default=REPO / "release" / "smollm2-135m")
    args = ap.parse_args()
    from ridgefill.engines.vllm import served

    with Bench("release_memory", args, None) as bench:
        tracemalloc.start()
        fill = served.load(args.release)
        held = tracemalloc.get_traced_memory()[0]
        formula = sum(4 * W.shape[0] * (W.shape[1] + 1) for W, _ in fill.maps.values())
        process = served.Process()
        process.remember(fill)
        del fill
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        bench.finish(kept / held, details={"release": str(args.release), "held_before_mib": held / 2**20,
                                           "held_after_mib": kept / 2**20, "maps_float32_mib": formula / 2**20},
                     checks={"no decoded map kept": process.fill.release.maps == {}})


if __name__ == "__main__":
    main()
