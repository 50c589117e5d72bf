"""What a request's `model` names, and what `/v1/models` lists: the OpenAI way to pick an adapter.

    <base>              the frozen base model, no LoRA (e.g. "SmolLM2-135M-Instruct")
    <name> or omitted   the current global adapter (`adapters.name`, default "collm-global")
    <name>@<version>    a retained earlier version (the last `adapters.retain` published)
    <name>:local        this edge's own adapter: the global plus what it trained on its local data
                        since (republished every `adapters.local_every` optimizer steps; the global
                        until then)

Each request keeps what it resolved to from its first token to its last (the engine pins it).
`resolve` is a pure function over plain data, so the API, the router and the tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from collm.edge_client.model.lora import BASE, LOCAL_VERSION


class UnknownModel(LookupError):
    """A `model` this edge does not serve; the message names what it does serve."""


@dataclass(frozen=True)
class Choice:
    """What a request is served with: None = the current global, else a version (`BASE.version`: no LoRA)."""

    version: int | None
    label: str  # the model id echoed in the response


def model_ids(base: str, name: str, retained: list[int]) -> list[str]:
    """Every id `resolve` accepts, in the order `/v1/models` lists them (the default first)."""
    return [name, f"{name}:local", *(f"{name}@{v}" for v in sorted(retained, reverse=True)), base]


def resolve(model: str | None, base: str, name: str, retained: list[int]) -> Choice:
    """The adapter a request's `model` selects (see the module docstring); UnknownModel otherwise."""
    if not model or model == name:
        return Choice(None, name)
    if model == base:
        return Choice(BASE.version, base)
    if model == f"{name}:local":
        return Choice(LOCAL_VERSION, model)
    head, sep, tail = model.partition("@")
    if sep and head == name:
        if tail.isdigit() and int(tail) in retained:
            return Choice(int(tail), model)
        raise UnknownModel(f"model '{model}': version {tail!r} is not retained on this edge; available: "
                           f"{', '.join(model_ids(base, name, retained))}")
    raise UnknownModel(f"model '{model}' does not exist here; available: {', '.join(model_ids(base, name, retained))}")
