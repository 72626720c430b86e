"""nulltickets: durable task state for AI agents."""

__version__ = "2026.11.29"

__all__ = ["__version__"]
