"""The engine core: scheduling and KV-cache memory. Pure Python, no torch."""
