"""Model compute of one edge: loading the frozen base, the step runner and KV pool, unmerged LoRA,
the shadow adapter that owns serving versions, and sampling."""
