"""The sweep artifact (docs/store.md, docs/sweep.md): `sweep.json` (every split's figures, the recommendation, the
rows measured), `sweep.png` (the plot) and `sweep.md` (the table, for a README)."""

from __future__ import annotations

import json

from ridgefill.artifacts import Artifact

RESULT, PLOT, TABLE = "sweep.json", "sweep.png", "sweep.md"
ARMS = ("ridgefill", "identity")  # the fills measured at every split (a split entry's "arms")


def load_result(art: Artifact) -> dict:
    return json.loads(art.file(RESULT).read_text())
