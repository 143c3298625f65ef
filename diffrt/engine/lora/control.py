"""The engine's adapter registration calls (``add_lora``, ``remove_lora``,
``list_loras``): a base of ``DiffusionEngine`` that keeps the facade small;
the work is ``registration.py``'s and the registry's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrt.engine.lora.registration import register, unregister
from diffrt.engine.lora.registry import AdapterRegistry, LoraInfo

if TYPE_CHECKING:
    from diffrt.engine.config import EngineConfig
    from diffrt.runtime.executor import Executor


class LoraControl:
    """Registering and removing adapters on a running engine (see the module)."""

    config: EngineConfig
    adapters: AdapterRegistry

    @property
    def executor(self) -> Executor:
        """The engine's executor (``DiffusionEngine`` gives it)."""
        raise NotImplementedError

    def add_lora(self, name: str, path: str) -> LoraInfo:
        """Register the adapter file (or folder) ``path`` as ``name``; every
        worker reads it on its loader thread while requests keep running, and
        this call returns once they all have it. ``LoraExistsError`` for a
        name registered already, ``AdapterFileError`` naming the file and why
        it is not an adapter this model can serve (the engine serves on)."""
        return register(self.adapters, lambda: self.executor, name, path,
                        self.config.model_config.lora_load_timeout_s)

    def remove_lora(self, name: str) -> None:
        """Refuse ``name`` in new requests (``KeyError`` when not registered);
        the requests accepted with it are served, and its weights leave the
        workers when the last of them ends."""
        unregister(self.adapters, self.executor, name)

    def list_loras(self) -> list[LoraInfo]:
        """The registered adapters, by name."""
        return self.adapters.infos()


__all__ = ["LoraControl"]
