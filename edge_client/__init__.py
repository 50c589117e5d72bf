"""collm-edge: one edge replica that serves and trains on one base model (engine, model, training, serve, federation)."""
