"""Server side: the ServerApp, run directory, central evaluation, in-process grid, CLI."""
