"""KV data plane: framed bulk transfers between nodes over UCX or plain asyncio TCP."""
