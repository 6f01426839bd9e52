"""Sample lifecycle: generate -> reward, per sample, with dynamic sampling, abort and async buffers."""
