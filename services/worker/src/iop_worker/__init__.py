"""IOP worker: runs OpenAI Batch jobs leased from the edge through the normal dispatch path."""

__version__ = "0.1.0"
