"""plimsoll.bench: load generator, saturation knees, reports and diagnose."""
