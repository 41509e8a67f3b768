"""Data plane: model runner, KV cache, speculative decoding, shard actors and the instance engine."""

import time

# when this process began importing the data plane: an instance actor's imports are a phase of its start
# (actors/start_phases.py; actors/serving/server.py reads it)
IMPORT_BEGAN = time.time()
