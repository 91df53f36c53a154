"""Ways into the worker: the process entry point (and, as they land, its listeners)."""
