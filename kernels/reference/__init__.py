"""Pure-torch reference implementations: the semantics of every op (CPU, fp32 or bf16)."""
