"""Typer command functions, one module per command; autopar.cli registers them."""
