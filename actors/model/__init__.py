"""Model side of the data plane: checkpoint loading and the layer runner."""
