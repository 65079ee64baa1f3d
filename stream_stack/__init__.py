"""The composition root: the ``stream-gateway`` command and ``up``, which run all three packages.

``stream_gateway`` (the gateway), ``pipeline`` (events, NATS) and ``consumers`` (trajectories,
batches, verl) each own their commands; this package is the one place that depends on all of
them: it puts their commands under one ``stream-gateway`` entry point and runs them together
on one machine (``stream-gateway up``).
"""
