"""The claims: one module per claim."""
