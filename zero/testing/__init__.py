"""Small models and data used by zero's tests, benchmarks and examples (like torch.testing)."""
