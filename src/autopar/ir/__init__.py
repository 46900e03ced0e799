"""The graph vocabulary every stage shares: nodes and values, where values live, units."""
