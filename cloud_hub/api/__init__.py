"""REST API of the hub."""
