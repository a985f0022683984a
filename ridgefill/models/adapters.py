"""Per-architecture access to decoder layers: norms, projections, RoPE, and what a layer writes to its cache.

The fill (docs/method.md#the-fill-at-run-time) replaces a late layer's input by a prediction and then needs exactly what that
layer would have written to its KV cache. `Adapter.kv(l, x)` computes it by calling the layer's own modules in
the order its forward does (input norm -> k_proj -> k_norm; input norm -> v_proj), so it matches the real
forward bit for bit (tests/test_models.py checks this with hooks). RoPE is left out: it is a rotation, so cosine
scores do not need it (docs/method.md#choosing-alpha), and a fill runtime applies it with `rotary` + `apply_rope`.

Supported: llama (and SmolLM2), qwen2 (q/k/v biases, no QK-norm), qwen3 and gemma3_text (QK-norm; Gemma 3 also
has separate RoPE for sliding and full-attention layers), and the hybrids qwen3_next and qwen3_5's text part
(Gated DeltaNet layers between gated-attention layers; `Qwen3NextAdapter`).

    ad = adapter_for(model)
    k, v = ad.kv(l, x)                         # x [rows, d] -> k, v [rows, kv_heads, head_dim]
    q = ad.q(l, x)                             # [rows, heads, head_dim]
    cos, sin = ad.rotary(positions, layer=l)   # [rows, head_dim]
    k_rot = ad.apply_rope(k, cos, sin)         # what lands in the cache

Devices: a model may be dispatched by accelerate over several devices and disk (`load_model(device_map=...)`).
`kv` and `q` call a layer's sub-modules directly, so they move their input to the layer's device first
(`layer_device`): its execution device when accelerate placed it (whose hooks then load offloaded weights for each
sub-module call), else where its weights are. Results stay on that device; callers move them where they need.
`device` is where the token embeddings run (the model's input device); `dtype` never reads weight values.
"""

from __future__ import annotations

import itertools

import torch

from ridgefill.errors import BadInput
from ridgefill.models.kinds import FULL, LINEAR, kinds_of



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
        self.vocab_size: int | None = getattr(cfg, "vocab_size", None)  # the token ids the model embeds: 0..vocab-1
        self.layer_kinds: list[str] = kinds_of(cfg)

    # -- modules -------------------------------------------------------------------------------------------

    def is_linear(self, l: int) -> bool:
        """Whether layer l is a Gated DeltaNet layer (a recurrent state, no KV cache): only on the hybrids."""
        return self.layer_kinds[l] == LINEAR

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

    # -- where things run -----------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype. Only the weight's dtype is read: a disk-offloaded weight sits on the `meta` device
        with its real dtype, which accelerate loads it in."""
        return self.layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model's input goes: the device the token embeddings compute on."""
        return module_device(self.base.embed_tokens, torch.device("cpu"))

    def layer_device(self, l: int) -> torch.device:
        """Where layer `l` computes (with accelerate's dispatch each layer may sit on another device, or on disk)."""
        return module_device(self.layers[l], self.device)

    def module_device(self, module) -> torch.device:
        return module_device(module, self.device)

    # -- what a layer writes -------------------------------------------------------------------------------

    def kv(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values layer `l` writes to its cache for input `x`, before RoPE.

        x: [rows, d] (any leading dims work), usually float32, on any device; it is cast to the model's dtype
        and moved to the layer's device first, as the residual stream would be. Returns k, v:
        [rows, kv_heads, head_dim] in the model's dtype, on the layer's device.
        """
        k, v = self.kv_raw(l, x)
        return self.k_post(l, k), v

    def kv_raw(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv` without the key norm: input norm -> k_proj, input norm -> v_proj. What a key/value map predicts
        (docs/method.md#keyvalue-maps): k, v [rows, kv_heads, head_dim] in the model's dtype, on the layer's device."""
        with torch.inference_mode():
            x = x.to(device=self.layer_device(l), dtype=self.dtype)
            h = self.input_norm(l)(x)  # [rows, d]
            heads = (*h.shape[:-1], self.num_kv_heads, self.head_dim)
            k = self.k_proj(l)(h).view(heads)  # [rows, kv_heads * head_dim] -> [rows, kv_heads, head_dim]
            v = self.v_proj(l)(h).view(heads)  # [rows, kv_heads, head_dim]
        return k, v.to(k.device)

    def k_post(self, l: int, k: torch.Tensor) -> torch.Tensor:
        """What layer `l` does to k_proj's keys [rows, kv_heads, head_dim] before RoPE: its per-head key norm on
        QK-norm models (cast to the model's dtype on the layer's device first), nothing otherwise."""
        norm = self.k_norm(l)
        if norm is None:
            return k
        with torch.inference_mode():
            return norm(k.to(device=self.layer_device(l), dtype=self.dtype))  # RMS over head_dim, per head

    def kv_target(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """What a key/value map of layer l predicts for input x [rows, d]: its keys before the key norm (k_proj's
        order, head by head), then its values, side by side: [rows, kv_width] in the model's dtype on the layer's
        device. `from_kv_target` turns such rows back into what the layer writes."""
        k, v = self.kv_raw(l, x)
        return torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)

    def from_kv_target(self, l: int, both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows laid out as `kv_target` [rows, kv_width] (any float dtype) -> what layer l writes before RoPE: keys
        through its key norm and values, [rows, kv_heads, head_dim] each, in the model's dtype."""
        both = both.to(self.dtype)
        heads = (both.shape[0], self.num_kv_heads, self.head_dim)
        half = both.shape[1] // 2
        return self.k_post(l, both[:, :half].reshape(heads)), both[:, half:].reshape(heads)

    @property
    def kv_width(self) -> int:
        """2 * kv_heads * head_dim: the width of an attention layer's keys and values side by side, what a key/value
        map predicts per row."""
        return 2 * self.num_kv_heads * self.head_dim

    def q(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """Queries of layer `l` for input `x` [rows, d], before RoPE: input norm -> q_proj (-> q_norm).

        Returns [rows, heads, head_dim] in the model's dtype on the layer's device; query head h reads KV head
        h // (heads // kv_heads).
        """
        with torch.inference_mode():
            x = x.to(device=self.layer_device(l), dtype=self.dtype)
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
        model's dtype, which is what the layers use (the module computes in float32, then casts). They are on
        the rotary module's device.
        """
        kind = FULL if layer is None else self.layer_kinds[layer]
        device = self.module_device(self.base.rotary_emb)
        with torch.inference_mode():
            pos = torch.as_tensor(positions, dtype=torch.long).to(device).reshape(1, -1)  # [1, rows]
            probe = torch.empty(0, dtype=dtype or self.dtype, device=device)  # only its dtype/device are read
            cos, sin = self._rope_module_call(probe, pos, kind)  # [1, rows, head_dim]
        return cos[0], sin[0]

    @staticmethod
    def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate k [rows, heads, head_dim] by (cos, sin) [rows, rotary_dim], as transformers' apply_rotary_pos_emb
        does (rotate_half convention: the two halves of the rotated dims are the pair). With partial rotary
        (rotary_dim < head_dim, as on the hybrids) only the first rotary_dim dims turn; the rest pass through."""
        cos, sin = cos.to(k.device)[:, None, :], sin.to(k.device)[:, None, :]  # [rows, 1, rot], over heads
        rot = cos.shape[-1]
        k, rest = k[..., :rot], k[..., rot:]
        half = rot // 2
        rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return torch.cat((k * cos + rotated * sin, rest), dim=-1)


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


class Qwen3NextAdapter(Adapter):
    """Qwen3-Next: a hybrid of Gated DeltaNet layers (`linear_attention`, `layers[l].linear_attn`) and gated
    attention layers (`full_attention`): QK-norm, partial rotary, and an output gate that q_proj computes beside
    the queries (q_proj's output holds, per head, the query then the gate).

    For a Gated DeltaNet layer there is no KV cache: what the layer keeps from a row is its contribution to the
    recurrent state, written from the row's input projections. `kv(l, x)` returns, for such a layer, the key and
    value parts of those projections (before the short convolution): k [rows, linear_key_heads, key_dim], v [rows,
    linear_value_heads, value_dim]. Solve scores a fill on them as it scores keys and values (docs/hybrid.md)."""

    model_type = "qwen3_next"
    has_qk_norm = True

    def q(self, l: int, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            x = x.to(device=self.layer_device(l), dtype=self.dtype)
            h = self.input_norm(l)(x)
            both = self.attn(l).q_proj(h).view(*h.shape[:-1], self.num_heads, 2 * self.head_dim)
            return self.attn(l).q_norm(both[..., : self.head_dim])  # the second half is the output gate

    def kv(self, l: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_linear(l):
            return super().kv(l, x)
        with torch.inference_mode():
            x = x.to(device=self.layer_device(l), dtype=self.dtype)
            k, v = self._linear_kv(self.layers[l].linear_attn, self.input_norm(l)(x))
        return k, v.to(k.device)

    def linear_log_gates(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """The log decay g [rows, value heads] (float32, <= 0) Gated DeltaNet layer l applies to its state as each
        row of x [rows, d] (its input, before the input norm) arrives: g = -exp(A_log) softplus(a + dt_bias)."""
        gdn = self.layers[l].linear_attn
        with torch.inference_mode():
            x = x.to(device=self.layer_device(l), dtype=self.dtype)
            a = self._linear_a(gdn, self.input_norm(l)(x))
            return -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)

    @staticmethod
    def _linear_a(gdn, h):
        # in_proj_ba holds, per key head, its value heads' b then their a
        ba = gdn.in_proj_ba(h).unflatten(-1, (gdn.num_k_heads, -1))  # [rows, key heads, 2 * value heads per key head]
        return ba[..., ba.shape[-1] // 2 :].reshape(*h.shape[:-1], gdn.num_v_heads)

    @staticmethod
    def _linear_kv(gdn, h):
        lead = h.shape[:-1]
        flat = h.reshape(1, -1, h.shape[-1])  # the projection's reordering wants [batch, rows, d]
        _, k, v, _, _, _ = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(flat), gdn.in_proj_ba(flat))
        return k.reshape(*lead, *k.shape[-2:]), v.reshape(*lead, *v.shape[-2:])


class Qwen3_5Adapter(Qwen3NextAdapter):
    """Qwen3.5's text part: the layout of Qwen3-Next with separate input projections in its Gated DeltaNet layers
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and a dense MLP. Its rotary embedding is multimodal (three
    position streams); for text the three are equal, which is ordinary partial rotary."""

    model_type = "qwen3_5_text"

    @staticmethod
    def _linear_a(gdn, h):
        return gdn.in_proj_a(h)

    @staticmethod
    def _linear_kv(gdn, h):
        _, k, v = torch.split(gdn.in_proj_qkv(h), [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        return k.unflatten(-1, (-1, gdn.head_k_dim)), v.unflatten(-1, (-1, gdn.head_v_dim))


def module_device(module, fallback: torch.device | None = None) -> torch.device | None:
    """Where `module` computes.

    A model dispatched by accelerate (`device_map`) carries an `AlignDevicesHook` (`module._hf_hook`, possibly
    inside a `SequentialHook`) on every placed block, and with offloading on every sub-module holding weights: its
    `execution_device` is where the hook moves inputs and, for offloaded weights, loads them (their parameters
    sit on the `meta` device in between). Without a hook, the module computes where its weights are: the first
    parameter or buffer not on `meta`. `fallback` when neither says (a module with no tensors)."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        where = getattr(h, "execution_device", None)
        if where is not None:
            return torch.device("cuda", where) if isinstance(where, int) else torch.device(where)
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type != "meta":
            return t.device
    return fallback


ADAPTERS = {cls.model_type: cls for cls in (Adapter, Qwen2Adapter, Qwen3Adapter, Gemma3Adapter, Qwen3NextAdapter,
                                            Qwen3_5Adapter)}


def adapter_for(model) -> Adapter:
    """The adapter for a loaded transformers causal LM, or BadInput for an unsupported architecture."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise BadInput(f"unknown architecture '{model_type}' (supported: {', '.join(sorted(ADAPTERS))})")
    return ADAPTERS[model_type](model)
