"""Command-line tools shipped with the edge: ``iopctl``, a read-only view of the catalog."""
