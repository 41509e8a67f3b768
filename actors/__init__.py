"""Data plane: model runner, KV cache, speculative decoding, shard actors and the instance engine."""

import time

# when this process began importing the data plane: an instance actor's imports are a phase of its start
# (actors/start_phases.py; actors/serving/server.py reads it)
IMPORT_BEGAN = time.time()

# The folders of actors/, lowest first: a module imports from its own folder and the folders below it, never one above
# (tests/unit/test_layering.py walks every import; docs/design.md, "Where things are", says why this order). The
# modules at actors/ itself (start_phases) are the base every folder may use, and import no folder.
LAYERS = ("transport", "kv", "model", "moe", "speculation", "shards", "executors", "engine", "serving")
