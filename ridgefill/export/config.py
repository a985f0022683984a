"""The export's settings (`ExportConfig`): what the release records beyond its maps, the default exact tail and how
it is applied. The command's options and a recipe's [export] table take their defaults from here. Light: no numpy,
no torch.

    cfg = ExportConfig(tail=512, configuration="ridgefill+rows", row_share=0.2)
    export(store, quantize_id, cfg, out, out_dir=Path("release/x"))      # export/build.py
"""

from __future__ import annotations

from dataclasses import dataclass

from ridgefill.runtime.rows import DEFAULT_TAIL


@dataclass(frozen=True)
class ExportConfig:
    tail: int = DEFAULT_TAIL  # the default exact tail the manifest records (`tail_default`)
    configuration: str | None = None  # one of formats.release CONFIGURATIONS; None: the plain fill
    row_share: float | None = None  # ridgefill+rows only: the share of prompt rows run exactly (None: the runtime's)
    sweep: str | None = None  # the sweep artifact that recommended the split and configuration, recorded with it
