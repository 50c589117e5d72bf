"""The replica engine: one step loop that serves requests and runs background work on one base model."""

from collm.edge_client.engine.engine import (AdmittedEvent, Engine, EngineError, EngineFailed, FinishEvent,
                                             PromptTooLong, QueueFull, Request, ShuttingDown, TokenEvent)

__all__ = ["AdmittedEvent", "Engine", "EngineError", "EngineFailed", "FinishEvent", "PromptTooLong", "QueueFull",
           "Request", "ShuttingDown", "TokenEvent"]
