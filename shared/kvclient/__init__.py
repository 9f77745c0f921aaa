"""A node's side of the kvcache service: the client, block and tail uploads, prefix loads."""
