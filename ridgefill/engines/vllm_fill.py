"""The RidgeFill fill inside vLLM's own forward, as an out-of-tree model (llama family, vLLM's CPU attention backend):
a prototype that measures the real speed-up in an unmodified engine (docs/engines.md, "The fill inside vLLM").

    from vllm import ModelRegistry
    ModelRegistry.register_model("RidgefillLlamaForCausalLM", "ridgefill.engines.vllm_fill:RidgefillLlamaForCausalLM")
    llm = LLM(fill_model_dir, max_num_batched_tokens=4096, enable_prefix_caching=False, ...)

(`register()` does the first line, for a `vllm.general_plugins` entry point.) The model folder is the model's own
(config.json, weights) with `"architectures": ["RidgefillLlamaForCausalLM"]` and a `"ridgefill"` entry in
config.json: {"maps": "ridgefill/maps-f32.safetensors" (per late layer `layer.<l>.weight` [d, d], `layer.<l>.bias` [d],
float32), "split": S, "tail": T, "anchor": A, "outliers": ratio}; `ridgefill.engines.prepare.fill_model_dir`
writes it.

In a step where a request's whole prompt is scheduled at once and is longer than T + A, its rows split as in the
reference runtime: layers 0..S-1 run every row; in each late layer the filled prefix rows only write keys and
values, from `W_l h_S + b_l` through the layer's own input norm, qkv projection and RoPE, into their cache slots
(`impl.do_kv_cache_update`); the exact rows (the anchor, and prefix rows whose split-state norm is above `outliers`
x the prefix median) and the tail run the whole layer, each run of exact rows as a sequence of its own ending at
its last row, so that it attends to exactly the slots before it. The late layers' attention metadata is rebuilt
for those query rows (the CPU backend's scheduler metadata included) and swapped in per layer. A chunked prompt, a
decode step, or a backend other than the CPU one runs the stock forward: correct, never faster. Imports: vLLM,
torch, safetensors and the standard library.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM

NAME = "RidgefillLlamaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(NAME, f"{__name__}:{NAME}")


class RidgefillLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        rf = getattr(vllm_config.model_config.hf_config, "ridgefill", None)
        if not isinstance(rf, dict):
            raise ValueError(f"{NAME} needs a 'ridgefill' entry in config.json (ridgefill.engines.prepare.fill_model_dir)")
        self.rf_split, self.rf_tail = int(rf["split"]), int(rf["tail"])
        self.rf_anchor, self.rf_outliers = int(rf.get("anchor", 1)), float(rf.get("outliers", 0))
        self.rf_maps_path = Path(vllm_config.model_config.model) / rf["maps"]
        self.rf_maps: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.rf_dtype = vllm_config.model_config.dtype
        self.rf_stats = {"filled_steps": 0, "stock_steps": 0, "filled_rows": 0}

    def _maps(self):
        if self.rf_maps is None:
            t = load_file(str(self.rf_maps_path))
            L = len(self.model.layers)
            self.rf_maps = {l: (t[f"layer.{l}.weight"].float(), t[f"layer.{l}.bias"].float())
                            for l in range(self.rf_split, L)}  # fmt: skip
        return self.rf_maps

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        plan = self._plan(positions)
        if plan is None:
            self.rf_stats["stock_steps"] += 1
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        return self._fill_forward(input_ids, positions, inputs_embeds, plan)

    # -- which rows fill, which run ----------------------------------------------------------------------------

    def _plan(self, positions):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if not isinstance(meta, dict):
            return None
        name = self.model.layers[self.rf_split].self_attn.attn.layer_name
        m = meta.get(name)
        if not isinstance(m, CPUAttentionMetadata) or not m.causal or m.dynamic_causal is not None:
            return None
        qsl, seq = m.query_start_loc.tolist(), m.seq_lens.tolist()
        T, A = self.rf_tail, self.rf_anchor
        fills = [i for i in range(len(seq)) if seq[i] == qsl[i + 1] - qsl[i] and seq[i] > T + A]
        return (qsl, seq, fills) if fills else None

    def _rows(self, qsl, seq, fills, h_split):
        """Per request: its pseudo-requests for the late layers ((token rows, kv length), in order) and its filled
        token rows. A filling request's exact rows (the anchor, and prefix rows whose split state is an outlier by
        norm, as in `runtime.rows.outlier_rows`) run every layer: each run of consecutive exact rows is a sequence
        of its own, ending at its last row, so that it attends to exactly the slots before it; then the tail."""
        T, A = self.rf_tail, self.rf_anchor
        pseudo, filled = [], []
        for i in range(len(seq)):
            start, n = qsl[i], qsl[i + 1] - qsl[i]
            if i not in fills:
                pseudo.append((torch.arange(start, start + n), seq[i]))
                continue
            p = n - T
            exact = set(range(min(A, p)))
            if self.rf_outliers:
                norms = h_split[start : start + p].float().norm(dim=-1)
                exact |= set(torch.nonzero(norms > self.rf_outliers * norms.median()).flatten().tolist())
            runs: list[list[int]] = []
            for j in sorted(exact):
                if runs and runs[-1][-1] == j - 1:
                    runs[-1].append(j)
                else:
                    runs.append([j])
            for run in runs:
                pseudo.append((start + torch.tensor(run), run[-1] + 1))
            pseudo.append((torch.arange(start + p, start + n), seq[i]))
            keep = torch.ones(p, dtype=torch.bool)
            keep[sorted(exact)] = False
            filled.append(start + torch.nonzero(keep).flatten())
            self.rf_stats["exact_rows"] = self.rf_stats.get("exact_rows", 0) + len(exact)
        return pseudo, (torch.cat(filled) if filled else torch.zeros(0, dtype=torch.long))

    def _late_metadata(self, m, pseudo, attn):
        """The attention metadata of the query rows alone: one sequence per pseudo-request."""
        from vllm import _custom_ops as ops
        from vllm import envs

        q_lens = torch.tensor([len(r) for r, _ in pseudo], dtype=m.query_start_loc.dtype)
        qsl = torch.zeros(len(pseudo) + 1, dtype=m.query_start_loc.dtype)
        qsl[1:] = torch.cumsum(q_lens, 0)
        seq_lens = torch.tensor([s for _, s in pseudo], dtype=m.seq_lens.dtype)
        owner = []  # each pseudo-request's block-table row: the request its rows belong to
        qsl_old = m.query_start_loc.tolist()
        for rows, _ in pseudo:
            owner.append(max(i for i in range(len(qsl_old) - 1) if qsl_old[i] <= int(rows[0])))
        impl = attn.impl
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(pseudo), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
            seq_lens=seq_lens, dtype=self.rf_dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa=attn.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
            kv_cache_dtype=impl.kv_cache_dtype)  # fmt: skip
        return dataclasses.replace(m, num_actual_tokens=int(qsl[-1]), max_query_len=int(q_lens.max()),
                                   query_start_loc=qsl, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
                                   block_table=m.block_table[torch.tensor(owner)], scheduler_metadata=sched,
                                   slot_mapping=m.slot_mapping[torch.cat([r for r, _ in pseudo])])  # fmt: skip

    # -- the forward -------------------------------------------------------------------------------------------

    def _fill_forward(self, input_ids, positions, inputs_embeds, plan):
        qsl, seq, fills = plan
        m, ctx = self.model, get_forward_context()
        h = inputs_embeds if inputs_embeds is not None else m.embed_input_ids(input_ids)
        residual = None
        for layer in m.layers[: self.rf_split]:
            h, residual = layer(positions, h, residual)
        h_split = h + residual  # the residual stream entering layer S (vLLM keeps it as two summands)
        pseudo, fill = self._rows(qsl, seq, fills, h_split)
        q_rows = torch.cat([r for r, _ in pseudo])
        if not fill.numel():
            for layer in m.layers[self.rf_split :]:
                h, residual = layer(positions, h, residual)
            self.rf_stats["stock_steps"] += 1
            return m.norm(h, residual)[0]
        maps = self._maps()
        hq, rq, pos_q = h[q_rows], residual[q_rows], positions[q_rows]
        x_fill, pos_f = h_split[fill].float(), positions[fill]
        meta0 = ctx.attn_metadata[m.layers[self.rf_split].self_attn.attn.layer_name]
        late_meta = self._late_metadata(meta0, pseudo, m.layers[self.rf_split].self_attn.attn)
        for l in range(self.rf_split, len(m.layers)):
            layer = m.layers[l]
            sa, attn = layer.self_attn, layer.self_attn.attn
            name = attn.layer_name
            slots = ctx.slot_mapping[name]
            W, b = maps[l]
            x = (x_fill @ W.T + b).to(self.rf_dtype)
            qkv, _ = sa.qkv_proj(layer.input_layernorm(x))
            q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
            q, k = sa.rotary_emb(pos_f, q, k)
            attn.impl.do_kv_cache_update(attn, k.reshape(-1, attn.num_kv_heads, attn.head_size).contiguous(),
                                         v.reshape(-1, attn.num_kv_heads, attn.head_size).contiguous(),
                                         attn.kv_cache, slots[fill])  # fmt: skip
            old_meta, old_slots = ctx.attn_metadata[name], slots
            ctx.attn_metadata[name], ctx.slot_mapping[name] = late_meta, slots[q_rows]
            try:
                hq, rq = layer(pos_q, hq, rq)
            finally:
                ctx.attn_metadata[name], ctx.slot_mapping[name] = old_meta, old_slots
        out_h, out_r = torch.zeros_like(h), torch.zeros_like(residual)
        out_h[q_rows], out_r[q_rows] = hq, rq
        self.rf_stats["filled_steps"] += 1
        self.rf_stats["filled_rows"] += int(fill.numel())
        return m.norm(out_h, out_r)[0]
