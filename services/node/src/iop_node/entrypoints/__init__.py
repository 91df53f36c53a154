"""Ways into the node: the process entry point (and, as they land, its listeners)."""
