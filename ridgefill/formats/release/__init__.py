"""The release format `ridgefill-maps/1` (docs/format.md): its names (names.py), the writer (write.py), the reader
(read.py: a folder verifies if and only if it loads) and the folder swap (folder.py). numpy only: a runtime that
reads releases needs nothing of the stages that write them.

    from ridgefill.formats import release
    manifest, maps = release.load_release("release/smollm2-135m")   # verified first
"""

from ridgefill.formats.release.folder import (check_out_dir, move_into_place, out_lock, recover, same_files, sibling,
                                              staging_dir)
from ridgefill.formats.release.names import (BIAS, CARD, CODES, CONFIGURATIONS, CORRECTIONS_FILE, DOC_FILES, FORMAT,
                                             GITATTRIBUTES, HUB_LEFTOVERS, MANIFEST, MAPS_FILE, META_FACTS,
                                             META_FORMAT, NOT_FACTS, PLAIN, PROJECTOR_DTYPES, PROTECTED_FILE,
                                             PROTECTED_IDS, SCALES, STATE_OFFSET, UNHASHED, WEIGHT, facts_json,
                                             facts_of, is_bare_name, offset_name, parse_tensor_name, tensor_name)
from ridgefill.formats.release.read import (Release, load_protected, load_release, load_state_offsets, read_manifest,
                                            read_release, read_tensors, release_configuration, verify_release)
from ridgefill.formats.release.write import write_eval, write_release

__all__ = ["BIAS", "CARD", "CODES", "CONFIGURATIONS", "CORRECTIONS_FILE", "DOC_FILES", "FORMAT", "GITATTRIBUTES",
           "HUB_LEFTOVERS", "MANIFEST", "MAPS_FILE", "META_FACTS", "META_FORMAT", "NOT_FACTS", "PLAIN",
           "PROJECTOR_DTYPES", "PROTECTED_FILE", "PROTECTED_IDS", "Release", "SCALES", "STATE_OFFSET", "UNHASHED",
           "WEIGHT", "check_out_dir", "facts_json", "facts_of", "is_bare_name", "load_protected", "load_release",
           "load_state_offsets", "move_into_place", "offset_name", "out_lock", "parse_tensor_name", "read_manifest", "read_release",
           "read_tensors", "recover", "release_configuration", "same_files", "sibling", "staging_dir", "tensor_name",
           "verify_release", "write_eval", "write_release"]  # fmt: skip
