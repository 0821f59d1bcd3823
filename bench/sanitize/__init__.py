"""compute-sanitizer's findings per kernel entry and per KV mode (bench/sanitize.sh drives it)."""
