"""Performance estimator: op inventory, hardware specs, SM-scaling roofline (Bullet §3.2), calibration, profiler."""
