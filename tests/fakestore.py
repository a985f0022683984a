"""A store chain without model weights: hand-made capture, solve and quantize artifacts holding exactly the files
and fields that `export` (release and GGUF) and `eval`'s source loader read, and a model folder holding only the
configuration (what export reads to describe the model). Shared by test_release.py and test_gguf_export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ridgefill.artifacts import Store
from ridgefill.formats import safetensors
from ridgefill.formats import int8

SPLIT, LAYERS = 9, (9, 10, 11)  # "layer.10" / "blk.10" sort before "layer.9": orders must be numeric
# Key/value maps (not square: orientation): 2 KV heads of 24 -> d_out 96; d_in, the hidden size, = 5 Q8_0 blocks and a
# ragged int8 group (128 + 32)
KV_HEADS, HEAD_DIM = 2, 24
D_OUT, D_IN = 2 * KV_HEADS * HEAD_DIM, 160
EXACT_NORM = 812.5  # the solve's exact-row norm: a release's `fit.exact_norm`
FP = "e" * 64  # what hand-made manifests use; fake_chain's model has its own fingerprint (`fake_model`)
MODEL_NAME = "Model-1"
CONFIG = {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": D_IN, "num_attention_heads": 4,
          "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 128, "vocab_size": 256}


def fake_model(root: Path, hidden: int = D_IN) -> tuple[Path, str]:
    """A model folder beside the store `root` holding config.json (12 llama layers of `hidden`; another width than
    D_IN gets a folder of its own) and a stand-in weights file (export reads no weight): (folder, fingerprint)."""
    from ridgefill.models.fingerprint import dir_fingerprint

    folder = Path(f"{root}-model" + ("" if hidden == D_IN else f"-{hidden}")) / MODEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": hidden}))
    safetensors.save(folder / "model.safetensors", {"unused": np.zeros(1, np.float32)})
    return folder, dir_fingerprint(folder)


def float_maps(seed: int = 0, d_in: int = D_IN) -> dict[int, dict[str, np.ndarray]]:
    """Rows spanning 1e-7..30 in magnitude (f16 subnormal scales up to large ones), a zero row, a zero block."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in LAYERS:
        row_scale = np.geomspace(1e-7, 30.0, D_OUT)[rng.permutation(D_OUT)]  # [d_out]
        w = (rng.standard_normal((D_OUT, d_in)) * row_scale[:, None]).astype(np.float32)  # [d_out, d_in]
        w[5] = 0.0
        w[7, 32:64] = 0.0
        out[layer] = {"weight": w, "bias": (rng.standard_normal(D_OUT) * 3).astype(np.float32)}
    return out


def calibration_mean(d_in: int = D_IN) -> np.ndarray:
    """A mean split state with one massive dimension (as Gemma 3 has), float64 [d_in]."""
    mean = np.random.default_rng(7).standard_normal(d_in) * 2.0
    mean[d_in // 3] = 4.5e4
    return mean


def fake_chain(root: Path, d_in: int = D_IN, group: int = int8.GROUP_SIZE,
               exact_norm: float | None = EXACT_NORM) -> dict[str, str]:
    """A capture (documents and split-9 statistics), a solve (float key/value maps of a `d_in`-wide model with
    `exact_norm`, or none: a solve from before format 5; report) and a quantize artifact (int8 maps at `group`,
    bias-corrected along the calibration mean as `quantize` does); returns their ids."""
    from ridgefill.capture.artifact import DOCS, STATS
    from ridgefill.capture.stats import Moments
    from ridgefill.quantize.artifact import QUANT
    from ridgefill.quantize.run import quantize_map
    from ridgefill.solve.artifact import MAPS, REPORT, kinds_metadata

    st = Store(root)
    folder, fp = fake_model(Path(root), d_in)
    model = {"name": MODEL_NAME, "revision": None, "model_type": "llama", "num_layers": 12, "hidden_size": d_in,
             "fingerprint": fp}
    docs = [{"name": "a", "role": "calibration", "sha256": "a" * 64, "tokens": 60},
            {"name": "b", "role": "held_out", "sha256": "b" * 64, "tokens": 40}]
    mean = calibration_mean(d_in)
    moments = Moments.empty(len(LAYERS), d_in, D_OUT)
    moments.n, moments.mean_x[:] = 59, mean
    with st.build("capture", {"stage": "capture", "model": fp, "skip_first": 1, "chat": False, "d_in": d_in}) as b:
        (b.path / DOCS).write_text(json.dumps(docs))
        safetensors.save(b.path / STATS, moments.to_arrays(f"raw.split{SPLIT}"),
                         {"splits": str(SPLIT), "variants": "raw"})
        cap = b.commit(info={"model": model, "model_spec": str(folder)})
    fm = float_maps(d_in=d_in)
    mean_scores = {"k_cosine": 0.9, "v_cosine": 0.8}
    report = {"split": SPLIT, "alpha": 1e-3, "lambda": 0.5, "rows": 59, "metric": "kv", "held_out_rows": 40,
              "fitted": {"mean": mean_scores}, "identity": {"mean": {"k_cosine": 0.7, "v_cosine": 0.5}}}
    with st.build("solve", {"stage": "solve", "capture": cap.id, "model": fp, "chat_share": None, "split": SPLIT}) as b:
        safetensors.save(b.path / MAPS, {f"layer.{l}.{k}": v for l, m in fm.items() for k, v in m.items()},
                         {"split": str(SPLIT), **({"exact_norm": repr(exact_norm)} if exact_norm is not None else {}),
                          **kinds_metadata({l: "kv" for l in LAYERS}, KV_HEADS, HEAD_DIM)})
        (b.path / REPORT).write_text(json.dumps(report))
        sol = b.commit(info={"capture": cap.id, "model": model}, summary={"layers": list(LAYERS), "split": SPLIT})
    arrays = {}
    for l, m in fm.items():
        codes, bits, bias_bits = quantize_map(m["weight"], m["bias"], mean, group)
        arrays[f"layer.{l}.codes"] = codes
        arrays[f"layer.{l}.scales"] = safetensors.BF16(bits)
        arrays[f"layer.{l}.bias"] = safetensors.BF16(bias_bits)
    with st.build("quantize", {"stage": "quantize", "solve": sol.id, "group_size": group}) as b:
        safetensors.save(b.path / QUANT, arrays, {"group_size": str(group)})
        q = b.commit(info={"solve": sol.id, "capture": cap.id, "model": model},
                     summary={"score_int8": 0.79, "score_float": 0.8, "split": SPLIT})
    return {"capture": cap.id, "solve": sol.id, "quantize": q.id}
