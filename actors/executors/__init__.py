"""Executors: how one forward of an instance runs (in process, over Ray stage actors, over expert-parallel ranks), behind one protocol."""
