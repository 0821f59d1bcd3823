"""decode.v1: the decode engine token streaming API."""
