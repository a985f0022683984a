"""The terminal-state offsets of a hybrid's filled Gated DeltaNet layers (`ridgefill solve --state-data`).

A Gated DeltaNet layer folds every filled row's error into the one recurrent state the tail inherits. The
terminal-state correction (ridgefill.runtime.corrections) adds, once at the end of the prefix, a fixed offset per
layer and value head, scaled by the filled rows' share of the state. The offset is measured here, with the maps just
solved, on documents kept apart from the calibration text:

- each document runs through the stock model once; for every late Gated DeltaNet layer its true inputs are kept;
- the layer's token mixer then runs over the document twice, chunk by chunk (`chunk` rows, default 2048): on the
  true inputs, and on the fill's inputs (every row from the map's prediction but row 0 and the rows above the
  exact-row norm, which the runtime runs exactly too);
- after each full chunk both recurrent states are read: offset = sum(exact - filled) / sum(share) over them, where
  share is the filled rows' share of that state (`filled_share`, per value head, near 1 here). Dividing by the
  share makes the offset the difference of a state with every row filled, which is what the runtime scales.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from ridgefill.errors import BadInput


def measure_offsets(lm, maps: dict, split: int, documents: list, chunk: int, row_norm: float | None,
                    out=None) -> tuple[dict, dict]:
    """{layer: offset float32 [value heads, key dim, value dim]} for the Gated DeltaNet layers above `split`, and
    what was measured. maps: {layer: (W [d, d], b [d])} float; documents: token id arrays; row_norm: the solve's
    exact-row norm (rows above it are not filled, as at run time)."""
    import torch
    from transformers import DynamicCache

    from ridgefill.runtime.corrections import filled_share
    from ridgefill.runtime.layers import Layers
    from ridgefill.runtime import exact_run
    from ridgefill.runtime.rows import norm_rows

    ad = lm.adapter
    linear = [l for l in range(split, ad.num_layers) if ad.is_linear(l)]
    if not linear:
        raise BadInput(f"--state-data: the terminal-state correction needs Gated DeltaNet layers above split {split}; "
                       "this model has none")
    layers = Layers(lm)
    diff = {l: 0.0 for l in linear}  # float64 sums [heads, dk, dv]
    share_sum = {l: 0.0 for l in linear}  # [heads]
    exact_norm = {l: 0.0 for l in linear}
    states = 0
    progress = out.progress("state offsets", total=len(documents)) if out is not None else nullcontext()
    with torch.no_grad(), progress as bar:
        for i, ids in enumerate(documents):
            ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
            n = int(ids.shape[0])
            run = exact_run(lm, ids, splits=[split] + linear)
            h_split = run.states[split]
            exact_rows = norm_rows(h_split, row_norm)
            exact_rows[0] = True
            for l in linear:
                dev = ad.layer_device(l)
                W, b = (torch.as_tensor(np.asarray(t), dtype=torch.float32, device=dev) for t in maps[l])
                x_true = run.states[l].to(dev)
                x_fill = (h_split.to(dev).float() @ W.T + b).to(x_true.dtype)
                keep = exact_rows.to(dev)
                x_fill[keep] = x_true[keep]
                gates = ad.linear_log_gates(l, x_fill)  # [n, heads]
                c_true, c_fill = DynamicCache(config=lm.model.config), DynamicCache(config=lm.model.config)
                for end in range(chunk, n + 1, chunk):
                    layers.mix(l, x_true[None, end - chunk : end], c_true)
                    layers.mix(l, x_fill[None, end - chunk : end], c_fill)
                    s_true = c_true.layers[l].recurrent_states[0][0].double().cpu().numpy()
                    s_fill = c_fill.layers[l].recurrent_states[0][0].double().cpu().numpy()
                    diff[l] = diff[l] + (s_true - s_fill)
                    share_sum[l] = share_sum[l] + filled_share(gates[:end], ~keep[:end]).cpu().numpy()
                    exact_norm[l] += float(np.linalg.norm(s_true))
            states += n // chunk
            if bar is not None:
                bar.update(i + 1, None, f"doc {i + 1}/{len(documents)}")
    if states == 0:
        raise BadInput(f"--state-data: no document reaches --state-chunk {chunk} tokens, so no state was measured")
    offsets = {l: (diff[l] / np.maximum(share_sum[l], 1e-12)[:, None, None]).astype(np.float32) for l in linear}
    info = {"states_per_layer": states, "chunk": chunk,
            "offset_norm": {str(l): round(float(np.linalg.norm(offsets[l])), 6) for l in linear},
            "exact_state_norm": {str(l): round(exact_norm[l] / states, 6) for l in linear}}  # fmt: skip
    return offsets, info

