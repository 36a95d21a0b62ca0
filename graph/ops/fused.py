"""Fused ops created by compiler passes (never by model descriptions); filled in by passes."""
