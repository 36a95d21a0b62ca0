"""Artifacts + checkpoint -> executable steps, scheduler, sampling, server."""
