"""Pure edge logic: the fleet catalog, provider pools, selection and per-model queues."""
