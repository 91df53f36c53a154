"""IOP control-plane: the fleet's authority for node tokens, API keys and fleet configuration."""

__version__ = "0.1.0"
