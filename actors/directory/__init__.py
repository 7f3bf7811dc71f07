"""The directory: block key -> where its copies are, in shards (``shard``)."""
