"""polar_fast: agentic RL on unmodified coding harnesses."""

__version__ = "0.1.0"
