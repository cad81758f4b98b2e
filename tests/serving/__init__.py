"""Tests against a real local Ray Serve deployment of the application (one cluster for the package)."""
