"""The ground floor: tree rules, tensor utilities, the checks and their wording, the optimizer
protocol. Imports nothing else of mpfunc."""
