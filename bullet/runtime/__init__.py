"""The multi-process runtime: shared model, launcher, supervision, frontend client."""
