"""The node's service layer: its providers (``providers``) and how a run is checked
(``run_check``) and executed (``runs``). Below the entrypoints, above the domain and the
adapters' ports; no protobuf here."""
