"""Coordinator: owns each request, runs the distributed speculation loop, serves the public API."""
