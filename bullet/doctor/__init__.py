"""`bullet doctor`: checks that this machine can run Bullet's workers as designed. Each check
returns a `CheckResult` (PASS / FAIL / SKIP with a reason); `bullet/commands/doctor.py` runs them
and prints the report."""
