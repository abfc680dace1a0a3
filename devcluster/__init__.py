"""plimsoll.devcluster: local Kubernetes control plane built from Go modules."""
