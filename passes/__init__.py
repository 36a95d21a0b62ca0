"""Graph -> Graph compiler passes, the per-hardware pipeline and the artifact writer."""
