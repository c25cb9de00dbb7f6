"""Worker processes: the prefill and decode loops and what they share (bootstrap, IO)."""
