"""The paged KV cache, the driver's ledger of it, and the links and channel a migration's KV travels over."""
