"""The engine's setting groups, one concept each: every group is a frozen dataclass that
checks its own settings (`contract.rules`) and owns its flags and ENGINE_* variables
(`contract.flags`); `engine_client.serve.config.EngineConfig` composes them and holds the rules
that tie groups together."""
