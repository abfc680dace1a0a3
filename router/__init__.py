"""plimsoll.router: queue-aware, prefix-affine HTTP router in front of replicas."""
