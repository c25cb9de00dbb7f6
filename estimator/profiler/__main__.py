"""`python -m estimator.profiler`: measure a profile (the same command as `bullet profile`)."""

import sys

from estimator.profiler.command import main

sys.exit(main())
