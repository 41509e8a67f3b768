"""Point-to-point transport: rendezvous of a group's addresses and the activations sent between stages."""
