"""Exhaustive check of the bf16 + remainder encoding over all 2^32 fp32 patterns."""
