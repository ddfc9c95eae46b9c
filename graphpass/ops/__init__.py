"""The custom ops a rewritten graph calls, and their per-chunk kernels: the chunked row-wise op
(`chunked_op`), its kernels split from one joint trace (`joint`) and kept single-pass (`peephole`)."""
