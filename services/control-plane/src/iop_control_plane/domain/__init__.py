"""Pure control-plane logic: fleet configuration, credentials, authorization (no I/O)."""
