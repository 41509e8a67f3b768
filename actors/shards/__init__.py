"""Shards: the roles a worker process plays (a pipeline stage, a draft group's leader or member, an expert rank) and their Ray actor classes."""
