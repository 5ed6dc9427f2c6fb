"""Loading: a model's weights brought onto the device as tuned (dtype, packing), and parked when swapped out."""
