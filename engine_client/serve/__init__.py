"""The engine as a server: the Decode gRPC server, the factory that builds an engine for a KV
mode, the engine's configuration, and the process supervisor used by demo, bench and tests."""
