"""The model: the directory format (modeldir), its validation, import from Hugging Face checkpoints and
GGUF files (convert, gguf_import, one module per family in families/), weight formats (dtypes, quant)
and the demo model. Imports nothing above it but errors and knobs."""
