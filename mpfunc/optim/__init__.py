"""The optimizers (each one's math and back ends together), torch.optim adapters, migration and
MasterOptimizer."""
