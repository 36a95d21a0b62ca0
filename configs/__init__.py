"""Model and hardware configs shipped as package data."""
