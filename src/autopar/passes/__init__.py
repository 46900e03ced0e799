"""Choices made on captured graphs and their plans: sharding, fusion."""
