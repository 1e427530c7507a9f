"""Two or more builds of the native kernel, one AdamW step each, in one process."""
