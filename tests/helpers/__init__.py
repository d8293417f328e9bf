"""Shared test helpers: tiny configs, corpora, rank spawning, launches (see each module)."""
