"""Heterogeneous placement: device catalog, layer splits, draft and expert groups, Ray placement groups."""
