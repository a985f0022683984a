"""Content-addressed artifact store (docs/store.md)."""

from ridgefill.artifacts.store import Artifact, Store, recipe_id, sha256_file

__all__ = ["Artifact", "Store", "recipe_id", "sha256_file"]
