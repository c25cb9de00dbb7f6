"""The shared types every part of Bullet uses: requests and their typed finish reasons, roles, SLOs,
the worker-state record, the wire messages and request validation."""
