"""Tiny random-weight models, built offline, for mechanics tests.

`make_tiny_model(dir, arch)` writes a transformers directory (config, safetensors weights, a tokenizer with an
eos token and a chat template) for one of the architectures `ridgefill.models` supports. `make_tiny_gguf(path)`
writes the tiny llama (or qwen2, qwen3) as an F32 GGUF that transformers can load, or, for any other architecture
name, a metadata-only GGUF that is good for `resolve_model` and nothing else.

Everything is deterministic from `seed`: the tokenizer is trained on fixed text below, the weights come from a
seeded generator, so two calls give byte-identical weight files (and the same fingerprint).

    from tiny import make_tiny_model
    path = make_tiny_model(tmp_path / "m", arch="qwen3")
"""

from __future__ import annotations

import json
from pathlib import Path

# Written for these tests (no third-party text): enough bytes for a few dozen BPE merges.
TEXT = """\
The ridge map predicts a late layer's input from the split state. Keys and values are written from the
prediction, and the tail of the prompt runs every layer exactly. A tiny model has four layers, a small
vocabulary and random weights; it cannot say anything useful, but its shapes and its plumbing are real.
def fill(x, w, b):
    return x @ w.T + b  # one matrix product per late layer
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation .,;:!?()[]{}<>=+-*/ and a second line of prose
so that the merges learn common pairs like "th", "er", "in", "an" and " the".
"""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]
# A minimal chat template: enough for `apply_chat_template` to work in tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 320  # 256 byte symbols + 6 specials + ~58 merges
ARCHS = ("llama", "gemma3_text", "qwen2", "qwen3", "qwen3_next", "qwen3_5")
HYBRIDS = ("qwen3_next", "qwen3_5")  # Gated DeltaNet layers between gated-attention layers


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer trained on TEXT, wrapped in PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level: every string encodes (no unknown token), like GPT-2 / SmolLM2.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str, *, layers: int, hidden: int, vocab_size: int, context: int = 256, kv_heads: int = 2):
    """A small config of `arch`: 4 query heads, `kv_heads` KV heads (GQA), head_dim = hidden / 4, a context of
    `context` positions."""
    from transformers import (Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3_5Config, Qwen3_5TextConfig,
                              Qwen3Config, Qwen3NextConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=hidden // 4,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "gemma3_text":
        # Alternate sliding / full layers so that 4 layers hold both kinds; a short window so that a 20-token
        # test input actually slides. Local and global RoPE keep Gemma's defaults (1e4 / 1e6), so they differ.
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return Gemma3TextConfig(**common, layer_types=kinds, sliding_window=8, query_pre_attn_scalar=hidden // 4)
    if arch in HYBRIDS:
        # Gated DeltaNet and gated-attention layers alternate, so that both kinds sit on each side of split 2;
        # grouped value heads (4 value heads on 2 key heads) and partial rotary (a quarter of head_dim), as the
        # real ones have. Qwen3-Next's odd layers get a mixture of experts with a shared expert.
        kinds = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        hybrid = dict(common, layer_types=kinds, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if arch == "qwen3_next":
            return Qwen3NextConfig(**hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                                   shared_expert_intermediate_size=hidden // 2, decoder_sparse_step=2)
        # Qwen3.5 ships as a vision-language checkpoint: the decoder's config is its text_config.
        text = Qwen3_5TextConfig(**hybrid).to_dict()
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden)
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(ARCHS)})")


def make_tiny_model(dirpath, arch: str = "llama", layers: int = 4, hidden: int = 64, seed: int = 0,
                    context: int = 256, kv_heads: int = 2) -> Path:
    """Save a random-weight `arch` model with a tokenizer to `dirpath`; return the path. `context`: its
    max_position_embeddings (the weights do not depend on it)."""
    import torch
    from transformers import AutoModelForCausalLM

    dirpath = Path(dirpath)
    tokenizer = make_tiny_tokenizer()
    config = tiny_config(arch, layers=layers, hidden=hidden, vocab_size=len(tokenizer), context=context,
                         kv_heads=kv_heads)
    torch.manual_seed(seed)
    if arch == "qwen3_5":  # the whole vision-language model, as the Hub has it; ridgefill loads its text part
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at 1 (or 0 for Gemma's 1+w), which would hide a skipped or misplaced norm: jitter them.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    model.eval()
    model.save_pretrained(dirpath)
    tokenizer.save_pretrained(dirpath)
    return dirpath


def _permute_for_gguf(w, n_head: int):
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute); transformers undoes it."""
    # [n_head * head_dim, d] -> [n_head, 2, head_dim/2, d] -> swap the two halves' axes -> back
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(path, arch: str = "llama", layers: int = 2, hidden: int = 64, seed: int = 0,
                   scale: dict | None = None) -> Path:
    """Write a tiny GGUF file to `path`.

    arch "llama", "qwen2" or "qwen3": that tiny model (same weights and tokenizer as `make_tiny_model(..., arch)`) as
    F32 tensors with a gpt2-style byte-level vocabulary, loadable by `from_pretrained(dir, gguf_file=name)`; `scale`
    {hf weight name: factor} multiplies a weight first. Llama's q/k rows are permuted as llama.cpp's converter does
    (transformers undoes it); Qwen's are not (llama.cpp rotates them NeoX-style, as transformers does). transformers
    reads no head_dim from a qwen3 GGUF and takes Qwen3Config's 128, so a qwen3 GGUF needs hidden = 4 * 128.
    Any other arch name (e.g. "gemma3", "foo"): metadata plus one dummy tensor, for resolve tests only.
    """
    import tempfile

    import gguf
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    if arch not in ("llama", "qwen2", "qwen3"):
        writer.add_tensor("token_embd.weight", np.zeros((4, hidden), dtype=np.float32))
        _finish(writer)
        return path

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        src = make_tiny_model(Path(tmp) / "m", arch, layers=layers, hidden=hidden, seed=seed)
        config = json.loads((src / "config.json").read_text())
        weights = load_file(src / "model.safetensors")
        tok = json.loads((src / "tokenizer.json").read_text())
    for name, factor in (scale or {}).items():
        weights[name] = weights[name] * factor

    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    if arch == "llama":
        writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = tok["model"]["vocab"]  # token -> id, byte-level spelling
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    if arch != "llama":
        writer.add_tokenizer_pre("qwen2")  # as Qwen's GGUFs: Qwen2's split regex (Qwen2Tokenizer sets it anyway)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight"}
    for p in "qkv":  # qwen2 has q/k/v biases
        names |= {f"self_attn.{p}_proj.weight": f"attn_{p}.weight", f"self_attn.{p}_proj.bias": f"attn_{p}.bias"}
    names |= {
        "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    }  # fmt: skip
    for i in range(layers):
        for hf, gg in names.items():
            w = weights.get(f"model.layers.{i}.{hf}")
            if w is None:
                continue
            if arch == "llama" and hf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                w = _permute_for_gguf(w, n_head if hf.startswith("self_attn.q") else n_kv)
            writer.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(w))
    _finish(writer)
    return path


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
