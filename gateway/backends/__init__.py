"""Generation backends: what serves the tokens behind the gateway (``base`` is the seam)."""
