"""Thin adapters that hand the real kernels their boundary argument in the form each one wants."""
