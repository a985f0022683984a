"""Solve: closed-form ridge maps over an alpha grid, chosen on held-out rows (DESIGN §4)."""
