"""Ways into the control-plane: the process entry point (and, as they land, its listeners)."""
