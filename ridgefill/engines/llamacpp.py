"""Load a ridgefill engine cache into llama.cpp through llama-cpp-python (docs/engines.md).

    from llama_cpp import Llama
    from ridgefill.engines.llamacpp import inject
    llm = Llama(model_path=gguf, n_ctx=4096, logits_all=True, type_k=0, type_v=0)   # F32 K/V
    inject(llm, "cache.safetensors", ids)      # positions 0..P-1 loaded; llm.n_tokens == P
    llm.eval(ids[P:])                          # llama.cpp computes the rest

`inject` learns the context's state layout (V transposed or not, K/V types, layers, KV heads, head_dim) from
llama.cpp itself, by reading back the state of a one-token decode (`probe`), reads the cache through the one strict
reader (`cache_state`: every rule of docs/cache.md, an engine cache for this model), converts it
(`layout.llama_state_from_cache`: keys into llama.cpp's rotation order where the model's RoPE is the interleaved
kind) and hands it to `llama_state_seq_set_data`. Also `python -m ridgefill.engines.llamacpp f32 IN.gguf OUT.gguf`:
a GGUF dequantized to F32 by llama.cpp's own quantizer (so that the engine and a float32 Hugging Face model run the
same weights). Imports: llama_cpp, numpy, the standard library and ridgefill's numpy-only cache format and errors.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np

from ridgefill.engines.layout import SeqState, llama_state_from_cache, read_seq_state, write_seq_state
from ridgefill.errors import BadInput
from ridgefill.formats.cache import ModelShape, read_cache


@dataclass(frozen=True)
class StateLayout:
    v_trans: bool
    k_type: int
    v_type: int
    rope_interleaved: bool  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i+1)
    num_layers: int | None = None  # the model's, as the probe found them (None: not checked)
    kv_heads: int | None = None
    head_dim: int | None = None


def seq_state(llm, seq_id: int = 0) -> bytes:
    import llama_cpp

    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    got = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    return bytes(buf[:got])


def clear(llm) -> None:
    """Empty the context's KV cache and forget its tokens."""
    import llama_cpp

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.n_tokens = 0


def probe(llm) -> StateLayout:
    """The context's state layout, read back from llama.cpp after decoding one token (then cleared)."""
    import llama_cpp

    clear(llm)
    llm.eval([llm.token_bos() if llm.token_bos() >= 0 else 0])
    state, k_type, v_type = read_seq_state(seq_state(llm))
    clear(llm)
    model = llm._model.model
    rope = llama_cpp.llama_model_rope_type(model)
    n_head_kv = getattr(llama_cpp, "llama_model_n_head_kv", None)  # older bindings lack it: heads then unchecked
    kv_heads = int(n_head_kv(model)) if n_head_kv is not None else None
    width = state.keys[0].shape[1] if state.keys else 0  # kv_heads * head_dim
    return StateLayout(state.v_trans, k_type, v_type, rope == llama_cpp.LLAMA_ROPE_TYPE_NORM, len(state.keys),
                       kv_heads, width // kv_heads if kv_heads else None)  # fmt: skip


def cache_state(cache_path, layout: StateLayout, fingerprint: str | None = None) -> SeqState:
    """The cache file as llama.cpp's sequence state for `layout`, read by the one strict reader: BadInput (one line
    naming the file, the tensor and the rule of docs/cache.md) unless it is an engine cache for this model (the
    probe's layers, KV heads and head_dim, and `fingerprint` where given). Needs no llama.cpp."""
    shape = ModelShape(layout.num_layers, layout.kv_heads, layout.head_dim, fingerprint)
    layers = read_cache(cache_path, shape, engine=True)
    return llama_state_from_cache(layers, rope_interleaved=layout.rope_interleaved, v_trans=layout.v_trans)


def inject(llm, cache_path, ids, layout: StateLayout | None = None, fingerprint: str | None = None) -> int:
    """Load the cache's P positions as sequence 0 of `llm` (cleared first), with ids[:P] as its tokens; returns P.
    BadInput, before the context is cleared, for a cache `cache_state` refuses or ids that leave nothing to compute."""
    import llama_cpp

    layout = layout or probe(llm)
    state = cache_state(cache_path, layout, fingerprint)
    if len(ids) <= len(state.positions):
        raise BadInput(f"{cache_path}: the cache holds {len(state.positions)} positions of a prompt of {len(ids)} "
                       f"tokens: the engine must compute at least the last")  # fmt: skip
    blob = write_seq_state(state, layout.k_type, layout.v_type)
    clear(llm)
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(blob), 0) != len(blob):
        raise RuntimeError("llama.cpp refused the injected sequence state")
    p = len(state.positions)
    llm.input_ids[:p] = np.asarray(ids[:p])
    llm.n_tokens = p
    return p


def f32(src: str, dst: str) -> None:
    """`src` GGUF dequantized to an all-F32 GGUF at `dst`, by llama.cpp's quantizer."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not convert {src} to F32")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "f32":
        raise SystemExit("usage: python -m ridgefill.engines.llamacpp f32 IN.gguf OUT.gguf")
    f32(sys.argv[2], sys.argv[3])
