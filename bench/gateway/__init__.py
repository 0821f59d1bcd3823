"""The OpenAI-compatible gateway against gRPC Generate. cli: the command; load: the streams."""
