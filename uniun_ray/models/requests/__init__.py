"""Requests and the registry: what a run asks for, which model it names, how it is checked. No torch."""
