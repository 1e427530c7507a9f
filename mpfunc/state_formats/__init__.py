"""How optimizer moments are stored (float32, bfloat16, 8-bit blocks): one module per format,
and the registry."""
