"""Names shared by the extraction, the probes and the command line, kept free of heavy imports."""

# Representations `lime_probe.extract` can read: the residual stream ("hidden", the embeddings and
# each block's output), the last block's normalised output ("final"), the raw per-layer keys/values
# and, for LIMe, the routed keys/values the heads really attend to (for ResFormer, its mixed values).
SITES = ("hidden", "final", "keys", "values", "routed_keys", "routed_values", "mixed_values")

# The paper's separability words (single tokens with their leading space).
DEFAULT_WORDS = (" is", " are", " was", " were")
