"""The only modules that import the optional libraries deep_ep and deep_gemm."""
