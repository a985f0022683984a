"""The release format `ridgefill-maps/2` (docs/format.md; `ridgefill-maps/1` is still read): its names (names.py),
the writer (write.py), the reader (manifest.py: the manifest and the folder; read.py: the tensors and the release
as applied; a folder verifies if and only if it loads) and the folder swap
(folder.py). numpy only: a runtime that reads releases needs nothing of the stages that write them.

    from ridgefill.formats import release
    rel = release.read_release("release/smollm2-135m")   # verified first
    rel.check_model(fingerprint=..., num_layers=..., hidden_size=..., num_kv_heads=..., head_dim=..., vocab_size=...,
                    name=..., where=..., dtype=...)
    rel.split, rel.tail, rel.anchor, rel.exact_norm, rel.configuration, rel.map_kinds, rel.kv_width, rel.output_bound
"""

from ridgefill.formats.release.folder import (check_out_dir, move_into_place, out_lock, recover, same_files, sibling,
                                              staging_dir)
from ridgefill.formats.release.names import (BIAS, CARD, CODES, CONFIGURATIONS, CORRECTIONS_FILE,
                                             DEFAULT_SKIP_FIRST_ROWS, DOC_FILES, FORMAT, FORMAT_V1, FORMATS,
                                             GITATTRIBUTES, HUB_LEFTOVERS, INPUT_MAP, KV_MAP, LINEAR_KIND, MANIFEST,
                                             MAP_KINDS, MAPS_FILE, MAX_MAP_OUTPUT, MAX_TAIL, META_FACTS, META_FORMAT,
                                             NOT_FACTS, PLAIN, PROJECTOR_DTYPES, PROTECTED_FILE, PROTECTED_IDS, SCALES,
                                             STATE_OFFSET, UNHASHED, WEIGHT, facts_json, facts_of, is_bare_name,
                                             offset_name, parse_tensor_name, tensor_name)
from ridgefill.formats.release.manifest import read_manifest
from ridgefill.formats.release.read import (Release, load_protected, load_release, load_state_offsets, map_bound,
                                            read_release, read_tensors, release_configuration, verify_release)
from ridgefill.formats.release.write import write_eval, write_release

__all__ = ["BIAS", "CARD", "CODES", "CONFIGURATIONS", "CORRECTIONS_FILE", "DEFAULT_SKIP_FIRST_ROWS", "DOC_FILES",
           "FORMAT", "FORMAT_V1", "FORMATS", "GITATTRIBUTES", "HUB_LEFTOVERS", "INPUT_MAP", "KV_MAP", "LINEAR_KIND",
           "MANIFEST", "MAP_KINDS", "MAPS_FILE", "MAX_MAP_OUTPUT", "MAX_TAIL", "META_FACTS", "META_FORMAT", "NOT_FACTS",
           "PLAIN", "PROJECTOR_DTYPES", "PROTECTED_FILE", "PROTECTED_IDS", "Release", "SCALES", "STATE_OFFSET",
           "UNHASHED", "WEIGHT", "check_out_dir", "facts_json", "facts_of", "is_bare_name", "load_protected",
           "load_release", "load_state_offsets", "map_bound", "move_into_place", "offset_name", "out_lock",
           "parse_tensor_name", "read_manifest", "read_release", "read_tensors", "recover", "release_configuration",
           "same_files", "sibling", "staging_dir", "tensor_name", "verify_release", "write_eval",
           "write_release"]  # fmt: skip
