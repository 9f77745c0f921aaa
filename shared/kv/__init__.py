"""Paged KV cache: block hashes, the block pool, the tensor store and the export format."""
