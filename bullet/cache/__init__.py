"""The prefix (radix) cache: K/V pages of finished requests kept for prompts that begin the same way."""
