"""Decoder layer kinds, by transformers' `layer_types` names (torch-free: the runtime's row rules and the stages'
checks read them without loading a model)."""

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
ATTENTION = (FULL, SLIDING)  # the kinds with a key/value cache (LINEAR: a Gated DeltaNet layer's recurrent state)


def kinds_of(config) -> list[str]:
    """The kind of each decoder layer of a transformers (text) config: its `layer_types`, or, for a model without
    them (llama), full attention everywhere."""
    return list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
