"""The `--help` layout every command of the project shares.

argparse's `ArgumentDefaultsHelpFormatter` appends "(default: X)" to every option, which says
"(default: None)" after a text that already explains what None means ("default: the embedded
model") and "(default: False)" after every switch. This formatter appends a default only where it
tells the reader something: the option takes a value, its default is set, and its text does not
already name one. It lives in the data plane because every layer's commands use it."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text:
            return text
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text  # a switch (store_true/false, count) or an option nobody set: nothing to add
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text
