"""Per-architecture access to decoder layers: norms, projections, RoPE, and what a layer writes to its cache.

The fill (DESIGN.md section 1) replaces a late layer's input by a prediction and then needs exactly what that
layer would have written to its KV cache. `Adapter.kv(l, x)` computes it by calling the layer's own modules in
the order its forward does (input norm -> k_proj -> k_norm; input norm -> v_proj), so it matches the real
forward bit for bit (tests/test_models.py checks this with hooks). RoPE is left out: it is a rotation, so cosine
scores do not need it (DESIGN.md section 4), and a fill runtime applies it with `rotary` + `apply_rope`.

Supported: llama (and SmolLM2), qwen2 (q/k/v biases, no QK-norm), qwen3 and gemma3_text (QK-norm; Gemma 3 also
has separate RoPE for sliding and full-attention layers).

    ad = adapter_for(model)
    k, v = ad.kv(l, x)                         # x [rows, d] -> k, v [rows, kv_heads, head_dim]
    q = ad.q(l, x)                             # [rows, heads, head_dim]
    cos, sin = ad.rotary(positions, layer=l)   # [rows, head_dim]
    k_rot = ad.apply_rope(k, cos, sin)         # what lands in the cache
"""

from __future__ import annotations

import torch

from ridgefill.errors import BadInput

FULL, SLIDING = "full_attention", "sliding_attention"


class Adapter:
    """Layer access for llama-style decoders (`model.model.layers[l].self_attn.{k,v}_proj`)."""

    model_type = "llama"
    has_qk_norm = False

    def __init__(self, model):
        self.model = model
        self.config = model.config
        # *ForCausalLM wraps the decoder in `.model`; a bare decoder (LlamaModel) already is it.
        self.base = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
        self.layers = self.base.layers
        cfg = self.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Models without layer_types (llama) have only full-attention layers.
        self.layer_kinds: list[str] = list(getattr(cfg, "layer_types", None) or [FULL] * self.num_layers)

    # -- modules -------------------------------------------------------------------------------------------

    def attn(self, l: int):
        return self.layers[l].self_attn

    def input_norm(self, l: int):
        return self.layers[l].input_layernorm

    def k_proj(self, l: int):
        return self.attn(l).k_proj

    def v_proj(self, l: int):
        return self.attn(l).v_proj

    def k_norm(self, l: int):
        """The per-head RMSNorm on keys, or None on models without QK-norm."""
        return getattr(self.attn(l), "k_norm", None) if self.has_qk_norm else None

    def attention_scaling(self, l: int) -> float:
        """The factor on q.k in this layer's softmax (1/sqrt(head_dim), or Gemma's query_pre_attn_scalar)."""
        return float(self.attn(l).scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    # -- what a layer writes -------------------------------------------------------------------------------

    def kv(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer `l` writes to its cache for input `x`, before RoPE.

        x: [rows, d] (any leading dims work), usually float32; it is cast to the model's dtype first, as the
        residual stream would be. Returns k, v: [rows, kv_heads, head_dim] in the model's dtype.
        """
        with torch.inference_mode():
            x = x.to(device=self.device, dtype=self.dtype)
            h = self.input_norm(l)(x)  # [rows, d]
            heads = (*h.shape[:-1], self.num_kv_heads, self.head_dim)
            k = self.k_proj(l)(h).view(heads)  # [rows, kv_heads * head_dim] -> [rows, kv_heads, head_dim]
            norm = self.k_norm(l)
            if norm is not None:
                k = norm(k)  # RMS over head_dim, per head
            v = self.v_proj(l)(h).view(heads)  # [rows, kv_heads, head_dim]
        return k, v

    def q(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """Queries of layer `l` for input `x` [rows, d], before RoPE: input norm -> q_proj (-> q_norm).

        Returns [rows, heads, head_dim] in the model's dtype; query head h reads KV head h // (heads // kv_heads).
        """
        with torch.inference_mode():
            x = x.to(device=self.device, dtype=self.dtype)
            h = self.input_norm(l)(x)
            q = self.attn(l).q_proj(h).view(*h.shape[:-1], self.num_heads, self.head_dim)
            norm = getattr(self.attn(l), "q_norm", None) if self.has_qk_norm else None
            return norm(q) if norm is not None else q

    # -- RoPE ----------------------------------------------------------------------------------------------

    def _rope_module_call(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str):
        return self.base.rotary_emb(x, position_ids)

    def rotary(self, positions, layer: int | None = None, dtype: torch.dtype | None = None):
        """(cos, sin), each [rows, head_dim], from the model's own rotary embedding for `layer`'s kind.

        positions: int tensor or list [rows]. layer=None means a full-attention layer. dtype defaults to the
        model's dtype, which is what the layers use (the module computes in float32, then casts).
        """
        kind = FULL if layer is None else self.layer_kinds[layer]
        with torch.inference_mode():
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(1, -1)  # [1, rows]
            probe = torch.empty(0, dtype=dtype or self.dtype, device=self.device)  # only its dtype/device are read
            cos, sin = self._rope_module_call(probe, pos, kind)  # [1, rows, head_dim]
        return cos[0], sin[0]

    @staticmethod
    def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate k [rows, heads, head_dim] by (cos, sin) [rows, head_dim], as transformers' apply_rotary_pos_emb
        does (rotate_half convention: the two halves of head_dim are the pair)."""
        cos, sin = cos[:, None, :], sin[:, None, :]  # [rows, 1, head_dim], broadcast over heads
        half = k.shape[-1] // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return k * cos + rotated * sin


class Qwen2Adapter(Adapter):
    """Qwen2: llama layout with biases on q/k/v (handled by the Linear modules), no QK-norm."""

    model_type = "qwen2"


class Qwen3Adapter(Adapter):
    """Qwen3: llama layout plus per-head RMSNorm on q and k (applied before the transpose)."""

    model_type = "qwen3"
    has_qk_norm = True


class Gemma3Adapter(Adapter):
    """Gemma 3 text: QK-norm, (1 + w) RMSNorms, interleaved sliding/full layers with their own RoPE bases."""

    model_type = "gemma3_text"
    has_qk_norm = True

    def _rope_module_call(self, x, position_ids, kind):
        # Gemma3RotaryEmbedding keeps one inverse-frequency table per layer kind (local 1e4, global 1e6).
        return self.base.rotary_emb(x, position_ids, kind)


ADAPTERS = {cls.model_type: cls for cls in (Adapter, Qwen2Adapter, Qwen3Adapter, Gemma3Adapter)}


def adapter_for(model) -> Adapter:
    """The adapter for a loaded transformers causal LM, or BadInput for an unsupported architecture."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise BadInput(f"unknown architecture '{model_type}' (supported: {', '.join(sorted(ADAPTERS))})")
    return ADAPTERS[model_type](model)
