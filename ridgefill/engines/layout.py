"""The engines' own KV layouts, and conversion from ridgefill's (docs/engines.md). numpy and the standard library only.

llama.cpp: a sequence's state as `llama_state_seq_get_data` writes it and `llama_state_seq_set_data` reads it
(`llama_context::state_seq_get_data` and `llama_kv_cache::state_write` in llama.cpp), all little-endian, for a
context with one KV stream:

    u32 magic 0xaf143cd8 | i32 seq_id
    u32 n_stream (1) | u32 cell_count
    cell_count x ( i32 pos | u32 n_seq_id (1) | i32 seq_id )
    u32 v_trans | u32 n_layer
    n_layer x ( i32 k_type | u64 k_row_bytes | cell_count rows of K [n_kv_heads * head_dim] )
    v_trans == 0:  n_layer x ( i32 v_type | u64 v_row_bytes | cell_count rows of V )
    v_trans == 1:  n_layer x ( i32 v_type | u32 v_elem_bytes | u32 n_embd_v | V transposed: n_embd_v x cell_count )

K and V rows are the KV heads one after another. Types are ggml's: 0 = F32, 1 = F16. For llama-family GGUFs the
converter permutes the q/k projections so that llama.cpp rotates adjacent pairs (2i, 2i+1) where Hugging Face
rotates (i, i + head_dim/2): a key in llama.cpp's order is a Hugging Face key with each head's two halves
interleaved (`to_ggml_rope_order`). Models whose GGUF keeps NeoX rotation (Gemma 3, ...) need no reordering.

vLLM needs no layout here: its connector writes through the attention backend's own cache-update kernel. A token
at prompt position p lives in slot `block_ids[p // block_size] * block_size + p % block_size` (`vllm_slots`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GGML_TYPES = {0: np.float32, 1: np.float16}  # ggml_type -> numpy dtype (the two a state holds here)
MAGIC = 0xAF143CD8  # llama.cpp's sequence-state magic


def to_ggml_rope_order(k: np.ndarray) -> np.ndarray:
    """Keys [..., head_dim] in Hugging Face's rotate-half order -> llama.cpp's interleaved-pair order."""
    hd = k.shape[-1]
    return k.reshape(*k.shape[:-1], 2, hd // 2).swapaxes(-1, -2).reshape(k.shape)


def from_ggml_rope_order(k: np.ndarray) -> np.ndarray:
    """The inverse of `to_ggml_rope_order`."""
    hd = k.shape[-1]
    return k.reshape(*k.shape[:-1], hd // 2, 2).swapaxes(-1, -2).reshape(k.shape)


@dataclass
class SeqState:
    """One sequence's KV state in llama.cpp's layout: per layer K and V [cells, n_kv_heads * head_dim]."""

    positions: np.ndarray  # int32 [cells]
    keys: list[np.ndarray]
    values: list[np.ndarray]
    v_trans: bool
    seq_id: int = 0


def write_seq_state(s: SeqState, k_type: int = 0, v_type: int = 0) -> bytes:
    """The bytes `llama_state_seq_set_data` reads for `s` (keys/values cast to the ggml types given)."""
    n = len(s.positions)
    if len(s.keys) != len(s.values):
        raise ValueError("keys and values need the same number of layers")
    out = [struct.pack("<IiII", MAGIC, s.seq_id, 1, n)]
    out += [struct.pack("<iIi", int(p), 1, s.seq_id) for p in s.positions]
    out.append(struct.pack("<II", int(s.v_trans), len(s.keys)))
    kt, vt = GGML_TYPES[k_type], GGML_TYPES[v_type]
    for k in s.keys:
        k = np.ascontiguousarray(k, dtype=kt)
        if k.shape[0] != n:
            raise ValueError(f"a layer has {k.shape[0]} key rows for {n} cells")
        out += [struct.pack("<iQ", k_type, k.shape[1] * k.itemsize), k.tobytes()]
    for v in s.values:
        v = np.ascontiguousarray(v, dtype=vt)
        if v.shape[0] != n:
            raise ValueError(f"a layer has {v.shape[0]} value rows for {n} cells")
        if s.v_trans:
            out += [struct.pack("<iII", v_type, v.itemsize, v.shape[1]), np.ascontiguousarray(v.T).tobytes()]
        else:
            out += [struct.pack("<iQ", v_type, v.shape[1] * v.itemsize), v.tobytes()]
    return b"".join(out)


def read_seq_state(blob: bytes) -> tuple[SeqState, int, int]:
    """(state, k_type, v_type) from `llama_state_seq_get_data`'s bytes; ValueError if they do not parse whole."""
    off = 0

    def take(fmt):
        nonlocal off
        vals = struct.unpack_from(fmt, blob, off)
        off += struct.calcsize(fmt)
        return vals

    def array(dtype, count):
        nonlocal off
        a = np.frombuffer(blob, dtype=dtype, count=count, offset=off)
        off += a.nbytes
        return a

    magic, _ = take("<Ii")
    if magic != MAGIC:
        raise ValueError(f"not a llama.cpp sequence state (magic {magic:#x})")
    n_stream, n = take("<II")
    if n_stream != 1:
        raise ValueError(f"a state of {n_stream} KV streams (one is supported)")
    pos, seq = np.empty(n, np.int32), 0
    for i in range(n):
        pos[i], n_seq, seq = take("<iIi")
        if n_seq != 1:
            raise ValueError(f"cell {i} belongs to {n_seq} sequences")
    v_trans, n_layer = take("<II")
    keys, values, types = [], [], []
    for _ in range(n_layer):
        t, row = take("<iQ")
        dt = np.dtype(GGML_TYPES[t])
        keys.append(array(dt, n * row // dt.itemsize).reshape(n, -1))
        types.append(t)
    for _ in range(n_layer):
        if v_trans:
            t, el, width = take("<iII")
            values.append(array(GGML_TYPES[t], width * n).reshape(width, n).T)
        else:
            t, row = take("<iQ")
            dt = np.dtype(GGML_TYPES[t])
            values.append(array(dt, n * row // dt.itemsize).reshape(n, -1))
        types.append(t)
    if off != len(blob):
        raise ValueError(f"{len(blob) - off} bytes left after the state")
    return SeqState(pos, keys, values, bool(v_trans), int(seq)), types[0], types[-1]


def llama_state_from_cache(layers: dict[int, dict[str, np.ndarray]], *, rope_interleaved: bool, v_trans: bool,
                           seq_id: int = 0) -> SeqState:
    """A ridgefill cache ({layer: {"keys", "values": [kv_heads, P, head_dim]}}, keys already at positions 0..P-1)
    as llama.cpp's sequence state at positions 0..P-1. The layers come from `ridgefill.formats.cache.read_cache`,
    which has checked them (docs/cache.md); what is checked again here is only what the conversion relies on."""
    keys, values = [], []
    first, n = None, None
    for l in sorted(layers):
        k, v = layers[l]["keys"], layers[l]["values"]
        if rope_interleaved:
            k = to_ggml_rope_order(k)
        h, p, hd = k.shape
        first, n = (l, p) if n is None else (first, n)
        if p != n:
            raise ValueError(f"layer {l} holds {p} positions, layer {first} {n}: an engine needs the same in every "
                             f"layer")  # fmt: skip
        if v.shape[:2] != (h, p):
            raise ValueError(f"layer {l} holds keys for {h} heads x {p} positions but values for "
                             f"{v.shape[0]} x {v.shape[1]}")  # fmt: skip
        keys.append(np.ascontiguousarray(k.transpose(1, 0, 2)).reshape(p, h * hd))
        values.append(np.ascontiguousarray(v.transpose(1, 0, 2)).reshape(p, -1))
    return SeqState(np.arange(n, dtype=np.int32), keys, values, v_trans, seq_id)


def vllm_slots(block_ids, block_size: int, start: int, stop: int) -> np.ndarray:
    """The paged-cache slots of prompt positions start..stop-1 for a request holding `block_ids`."""
    pos = np.arange(start, stop)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
