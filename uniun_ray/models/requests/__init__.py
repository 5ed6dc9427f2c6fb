"""Requests: what a run asks for, its prompt and tools, and how it is checked against a vocabulary. No torch."""
