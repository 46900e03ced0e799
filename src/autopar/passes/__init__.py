"""Choices made on captured graphs and their plans: sharding, the data-parallel split, fusion,
CUDA graphs."""
