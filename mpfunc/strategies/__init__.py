"""How fp32 masters are held (fp32, none, kahan, remainder, stochastic): one module per
strategy, and the registry."""
