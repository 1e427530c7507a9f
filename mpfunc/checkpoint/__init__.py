"""State dicts and checkpoint files."""
