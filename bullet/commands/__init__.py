"""Subcommands of the `bullet` CLI (one module each; see bullet/cli.py)."""
