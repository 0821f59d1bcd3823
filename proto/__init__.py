"""Protocol contracts (the .proto sources) and their generated Python code."""
