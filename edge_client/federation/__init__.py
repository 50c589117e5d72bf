"""The edge's side of Flower: the ClientApp handlers and the in-process SuperNode task executor."""
