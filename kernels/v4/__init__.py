"""v4: reference, capturable and fast kernels of the family."""
