"""Decoder layer kinds, by transformers' `layer_types` names (torch-free: the runtime's row rules and the stages'
checks read them without loading a model)."""

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
ATTENTION = (FULL, SLIDING)  # the kinds with a key/value cache (LINEAR: a Gated DeltaNet layer's recurrent state)
