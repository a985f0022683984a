"""The three parts of a filling step that run on the device, compiled as vLLM compiles its own forward
(`support_torch_compile`; ridgefill.engines.vllm.model builds them, each under a model tag of its own, and runs them):
the early layers on every scheduled token (`Early`), the filled rows' keys and values (`Filled`) and the exact rows'
late layers with the final norm (`Late`); and what the maps read (`stacked`)."""

from __future__ import annotations

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear


@support_torch_compile(dynamic_arg_dims={"h": 0, "positions": 0})
class Early(nn.Module):
    """Layers 0..S-1 on every scheduled token, from its embedding: (hidden, residual) entering layer S, vLLM's two
    summands, then the states entering the `earlier` layers (in that order: what maps from earlier states read
    beside h_S). The layers are the model's own (registered here too; their weights are loaded once, as the
    model's)."""

    def __init__(self, *, vllm_config, prefix: str = "", layers=(), earlier=()):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.earlier = tuple(earlier)

    def forward(self, h: torch.Tensor, positions: torch.Tensor):
        residual = None
        kept = {}
        for l, layer in enumerate(self.layers):
            if l in self.earlier:
                kept[l] = h if residual is None else h + residual  # the residual stream entering layer l
            h, residual = layer(positions, h, residual)
        return (h, residual, *(kept[l] for l in self.earlier))


@support_torch_compile(dynamic_arg_dims={"h": 0, "residual": 0, "positions": 0})
class Late(nn.Module):
    """Layers S..L-1 and the final norm on the exact rows (attending through whatever late-layer metadata the
    forward context holds: the fill swaps in the exact rows' own)."""

    def __init__(self, *, vllm_config, prefix: str = "", layers=(), norm=None):
        super().__init__()
        self.layers, self.norm = nn.ModuleList(layers), norm

    def forward(self, h: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor):
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


@support_torch_compile(dynamic_arg_dims={"x": 0, "positions": 0})
class Filled(nn.Module):
    """Every late layer's keys (normed where the model norms them, rotated) and values for the filled rows, from
    their split states: a key/value map gives them directly, `[k; v] = M_l h_S + c_l` (the rank's KV heads' rows);
    an input map predicts the input `W_l h_S + b_l` (column-parallel: d / tp rows per rank, all-gathered), then the
    layer's input norm and a copy of its key/value projection rows. Returns per-layer keys and values, [F, kv_size]
    each, as the backend's cache update takes them."""

    def __init__(self, *, vllm_config, prefix: str = "", layers=(), kv_maps=(), local: int = 0, states: int = 1):
        super().__init__()
        d = vllm_config.model_config.hf_config.hidden_size
        d_in = d * states  # what the maps read: h_S, or h_S with the earlier states beside it
        self.layers, self.kv_maps = nn.ModuleList(layers), list(kv_maps)
        first = layers[0].self_attn
        # What each late layer's map predicts: its input (d wide), or its keys and values. A key/value map is cut to
        # this tensor-parallel rank's KV heads (vLLM's sharding, `loads.rank_heads`): each rank holds and multiplies
        # only the rows of the keys and values it caches, with no communication. An input map is column-parallel:
        # each rank holds and multiplies d / tp of its output rows, then one all-gather per late layer and step
        # gives every rank the whole prediction its input norm needs.
        self.maps = nn.ModuleList(
            ReplicatedLinear(d_in, local, bias=True, quant_config=None, prefix=f"{prefix}.maps.{i}") if kv else
            ColumnParallelLinear(d_in, d, bias=True, gather_output=True, quant_config=None,
                                 prefix=f"{prefix}.maps.{i}")
            for i, kv in enumerate(self.kv_maps))  # fmt: skip
        # For an input map, the key/value rows of the layer's qkv projection, as a projection of their own: the
        # filled rows compute no query. Copied from the loaded weights (EngineFill.load), before vLLM repacks them
        # for its kernels. A key/value map needs none (an identity in its place).
        biased = [layer.self_attn.qkv_proj.bias is not None for layer in layers]
        self.kv = nn.ModuleList(
            nn.Identity() if kv else
            QKVParallelLinear(d, first.head_dim, 0, first.total_num_kv_heads, bias=bias, quant_config=None,
                              prefix=f"{prefix}.kv.{i}")
            for i, (kv, bias) in enumerate(zip(self.kv_maps, biased)))  # fmt: skip

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        keys, values = [], []
        for layer, kv_map, map_, proj in zip(self.layers, self.kv_maps, self.maps, self.kv):
            sa = layer.self_attn
            if kv_map:
                kv = map_(x)[0]  # [F, 2 * kv_size]: keys before the key norm and RoPE, then values
            else:
                kv = proj(layer.input_layernorm(map_(x)[0]))[0]  # W_l h_S + b_l, its norm, its keys and values
            k, v = kv.split([sa.kv_size, sa.kv_size], dim=-1)
            if hasattr(sa, "k_norm"):  # Qwen3: RMSNorm per head before the rotary embedding
                k = sa.k_norm(k.reshape(k.shape[0], -1, sa.head_dim)).reshape(k.shape)
            keys.append(sa.rotary_emb(positions, k.contiguous(), None)[0])  # rotated as a query would be
            values.append(v)
        return tuple(keys), tuple(values)


def stacked(h_split: torch.Tensor, kept: list) -> torch.Tensor:
    """What the maps read for every row: h_S [T, d], or [h_S; h_l1; ...] [T, d x states] (maps from earlier
    states; the reference runtime's `runtime.fill.stacked`)."""
    return torch.cat([h_split, *kept], dim=-1) if kept else h_split
