"""The edge's HTTP surface: OpenAI-compatible API, request schema, Prometheus metrics."""
