"""Shared fixtures: tiny random-weight models the tests make, and free loopback ports."""
