"""Consumers of generation events: trajectory assembly, rewards, verl batches.

Filled in by the consumers work; never imports :mod:`stream_gateway`.
"""
