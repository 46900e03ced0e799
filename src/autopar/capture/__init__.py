"""Capture: a function, or a graph dynamo hands over, turned into a Graph of ATen ops."""
