"""The eval artifact (docs/store.md): `results.json`, every measured row (documents, needles, timing) and the
summary; the summary is also the artifact's `summary` in artifact.json."""

from __future__ import annotations

import json

from ridgefill.artifacts import Artifact

RESULTS = "results.json"


def load_results(art: Artifact) -> dict:
    return json.loads(art.file(RESULTS).read_text())
