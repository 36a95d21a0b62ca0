"""gemm: reference, capturable and fast kernels of the family."""
