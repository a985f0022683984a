"""Solve: closed-form ridge maps over an alpha grid, chosen on held-out rows (docs/method.md, "Ridge maps"
and "Choosing alpha")."""
