"""Generation events: schemas, NATS JetStream publishing, and the embedded nats-server.

Owned contract between the gateway and the consumers (see DESIGN.md); filled in by the event
pipeline work.
"""
