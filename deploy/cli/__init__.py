"""The `specfleet` command line and the typed admin client it (and any script) drives the app with."""

from deploy.cli.main import main

__all__ = ["main"]
