"""The control-plane's adapters: the fleet file, the SQLite credential store, protobuf."""
