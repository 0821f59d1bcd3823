"""Text in, text out: the vocabulary (tokenizer, chat format, model vocabulary size) and the
incremental detokenizer with stop strings. Imports no other part of engine_client."""
