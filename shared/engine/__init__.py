"""The inference engine: sequences, sampling, scheduling and the continuous-batching loop."""
