"""The edge's adapters: the control-plane client, the node listener, the history store."""
