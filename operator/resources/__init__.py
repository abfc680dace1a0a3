"""Pure builders: spec -> Kubernetes object dicts. No I/O."""
