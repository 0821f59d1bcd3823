"""The command line: `python -m engine_client {serve,generate,demo}` (main), the streaming
decode client (generate), the demo, and the client commands' configuration."""
