"""`bullet` command line. Each subcommand lives in its own module under `bullet/commands/` and
exposes `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`; they are discovered here,
so adding a command never edits this file. A command module is named after its command, and only
the one invoked is imported (`bullet simulate` need not load torch, which `bullet doctor` does)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import bullet.commands
from bullet import __version__
from engines.help_format import DefaultsHelpFormatter


def _command_names() -> list[str]:
    return sorted(i.name for i in pkgutil.iter_modules(bullet.commands.__path__) if not i.name.startswith("_"))


def _commands(only: str | None = None):
    for name in _command_names():
        if only is None or name == only:
            yield importlib.import_module(f"bullet.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bullet",
        description="Bullet LLM serving runtime: concurrent prefill/decode workers with dynamic compute partitioning.",
    )
    parser.add_argument("--version", action="version", version=f"bullet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands(only):
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=DefaultsHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    invoked = argv[0] if argv and argv[0] in _command_names() else None
    parser = build_parser(invoked)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
