"""Pure node logic: execution specs, run events, provider health, admission (no I/O)."""
