"""The IR: typed values with symbolic dims, nodes, the op registry, text format, interpreter."""
