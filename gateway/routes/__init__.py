"""HTTP routes, one module per area; each route stays thin and delegates to the services."""
