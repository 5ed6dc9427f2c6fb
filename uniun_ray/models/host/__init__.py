"""Host tuning: how this host reads a model's weights and runs them (dtype, threads, packing, probes)."""
