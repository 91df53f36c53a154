"""Pure batch logic: what a lease grants and what this worker has seen of its lines."""
