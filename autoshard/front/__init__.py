"""The front door: the API, one call, files, the integrations."""
