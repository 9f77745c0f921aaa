"""Model runtime: find a model, convert it once to a safetensors cache, load it, run its forward."""
