"""collm-router: the OpenAI-compatible front door that routes each request to the edge with the most SLO slack."""
