"""Sizing a run before it starts: the engine's memory model and the longest sequence that fits."""
