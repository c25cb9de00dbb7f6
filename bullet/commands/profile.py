"""`bullet profile`: the profiler's own command (`estimator.profiler.command`), under the CLI."""

from estimator.profiler.command import DESCRIPTION, HELP, NAME, add_arguments, run

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]
