"""Declarative model descriptions (config -> step graph) and checkpoint I/O."""
