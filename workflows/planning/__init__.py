"""Planning a job: recipe, stage resources, layout, placement, preflight, the spec."""
