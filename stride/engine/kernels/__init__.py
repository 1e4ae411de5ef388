"""Triton kernels: paged decode attention, the fused layer ops, programmatic dependent launch."""
