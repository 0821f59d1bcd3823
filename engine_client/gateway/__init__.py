"""The OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions (stream=true as
server-sent events) and /v1/models on aiohttp, in front of the engine's gRPC Generate. A decode
client like the CLI: it imports the client library and the contract, never the engine."""
