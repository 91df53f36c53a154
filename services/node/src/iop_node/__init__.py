"""IOP node: runs next to providers: adapters, probes, capacity gate and FIFO queue, run history."""

__version__ = "0.1.0"
