"""Decoding: the engine, its batch of rows stepped together, and each row's tokens and text."""
