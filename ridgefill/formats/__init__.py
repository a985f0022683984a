"""Every file format ridgefill reads and writes, and nothing above them: safetensors bytes (safetensors.py, the one
reader), int8 maps (int8.py), the release folder (release/), the maps GGUF (gguf.py), a model GGUF's header
(gguf_header.py) and the KV-cache format (cache.py). They import only `ridgefill.errors`, `ridgefill.numerics` and
`ridgefill.artifacts` (hashing), so a runtime that reads a release needs no stage that writes one."""
