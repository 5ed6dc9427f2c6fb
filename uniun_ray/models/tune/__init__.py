"""Host tuning: which dtype and thread count run fastest here, measured on a quiet host."""
