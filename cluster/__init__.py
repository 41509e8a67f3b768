"""Control plane: typed config, request model, router, global scheduler and its policies."""
