"""The artifact evaluation: one command (`bash artifact/run_all.sh`) that runs every benchmark,
comparison and figure of docs/results.md as resumable steps and writes one report,
`artifact/results/<run>/report.md`. `steps.py` says what runs in each mode, `runner.py` runs it,
`report.py` writes the report."""
