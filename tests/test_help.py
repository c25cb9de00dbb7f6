"""Every command's `--help` names each option's default once, and only where it tells the reader
something: never "(default: None)" after a text that explains what unset means, nor
"(default: False)" after a switch."""

from __future__ import annotations

import argparse
import re

import pytest

from bullet.cli import _command_names, build_parser
from engines.help_format import DefaultsHelpFormatter
from estimator.profiler import command as profiler_command


def _option_texts(help_text: str) -> list[str]:
    """The help text split into one entry per option (an entry starts at a line indented two spaces
    with a dash)."""
    entries: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            entries.append(line)
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
        else:
            entries.append("")
    return [" ".join(e.split()) for e in entries if e]


def _command_help(name: str) -> str:
    parser = build_parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name].format_help()


def _profiler_help() -> str:
    parser = argparse.ArgumentParser(prog="python -m estimator.profiler", formatter_class=DefaultsHelpFormatter)
    profiler_command.add_arguments(parser)
    return parser.format_help()


@pytest.mark.parametrize("name", [*_command_names(), "python -m estimator.profiler"])
def test_each_option_names_its_default_at_most_once_and_never_as_none_or_false(name):
    text = _profiler_help() if name.startswith("python") else _command_help(name)
    options = _option_texts(text)
    assert len(options) > 3, text
    for option in options:
        assert option.count("(default") <= 1, option
        assert "(default: None)" not in option and "(default: False)" not in option, option


def test_a_value_default_is_shown_and_a_switch_or_unset_option_gets_none():
    parser = argparse.ArgumentParser(prog="x", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.5, help="requests per second")
    parser.add_argument("--quick", action="store_true", help="fewer states")
    parser.add_argument("--output", help="where to write")
    parser.add_argument("--cores", help="cores to use (default: all allowed)")
    options = {o.split()[0]: o for o in _option_texts(parser.format_help())}
    assert options["--rate"].endswith("requests per second (default: 2.5)")
    assert options["--quick"].endswith("fewer states")
    assert options["--output"].endswith("where to write")
    assert options["--cores"].endswith("cores to use (default: all allowed)")


def test_launch_says_unset_where_a_field_has_no_default_and_its_text_names_none():
    options = {o.split()[0].rstrip(","): o for o in _option_texts(_command_help("launch"))}
    assert options["--api-key"].endswith("(default: unset)")
    assert options["--policy"].endswith("(default: bullet)")
    assert options["--port"].endswith("(default: 30000)")
    assert options["--disable-radix-cache"].endswith("(default: off)")
