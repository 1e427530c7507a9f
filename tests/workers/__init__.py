"""Scripts the tests run in subprocesses (one rank, one resumed run); importable too."""
