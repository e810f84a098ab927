"""Pallas Mosaic GPU kernels for Hopper (sm90): not built yet."""
