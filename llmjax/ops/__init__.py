"""Native CPU operators outside attention (called from jitted JAX through the XLA FFI)."""
