"""Model families (registry), tiny random-weight builders, and model loading."""
