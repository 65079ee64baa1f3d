"""The control plane beside the request path: who may call (tenants and their limits), which
policy the engine serves (following published weights), and which inference servers a remote
engine uses (following the upstreams bucket)."""

from stream_gateway._errors import PolicyNotNewer
from stream_gateway.control._policy_sync import PolicyApplier, PolicyFollower
from stream_gateway.control._tenants import KeyEntry, KeyRing, Limits, RateLimited, RateLimiter, read_key_file
from stream_gateway.control._upstream_sync import UpstreamFollower

__all__ = [
    "KeyEntry",
    "KeyRing",
    "Limits",
    "PolicyApplier",
    "PolicyFollower",
    "PolicyNotNewer",
    "RateLimited",
    "RateLimiter",
    "UpstreamFollower",
    "read_key_file",
]
