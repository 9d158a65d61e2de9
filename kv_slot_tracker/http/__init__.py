"""The HTTP layer: request parsing and validation, error mapping, routes."""
