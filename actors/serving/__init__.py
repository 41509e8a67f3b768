"""Serving one instance: the engine facade, the serving loop, the Ray actor that serves it, leases, building it."""
