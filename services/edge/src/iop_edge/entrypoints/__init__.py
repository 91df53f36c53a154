"""Ways into the edge: the process entry point (and, as they land, its listeners)."""
