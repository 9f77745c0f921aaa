"""Code common to Tandem's services: model runtime, KV layout, engine, wire schemas, planes."""
