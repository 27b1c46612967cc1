"""Old module paths, kept for imports written before the package was laid out as it is now: importing one gives the
module at its new path (the same module object), and ``python -m`` runs the new module's code."""

from __future__ import annotations

import importlib
import importlib.util
import sys

MOVED = {
    "trl_async.arithmetic": "trl_async.demo.arithmetic",
    "trl_async.code_task": "trl_async.demo.code_task",
    "trl_async.evaluation": "trl_async.demo.evaluation",
    "trl_async.pretrained": "trl_async.demo.pretrained",
    "trl_async.tiny": "trl_async.demo.tiny",
    "trl_async.vllm_serve": "trl_async.engines.vllm.serve",
    "trl_async.vllm_plugin": "trl_async.engines.vllm.plugin",
    "trl_async.sync": "trl_async.weights",
    "trl_async.sync.adapters": "trl_async.weights.lora",
    "trl_async.sync.gloo": "trl_async.weights.gloo",
    "trl_async.sync.policy": "trl_async.weights.policy",
    "trl_async.sync.shared_memory": "trl_async.weights.shared_memory",
    "trl_async.engines.vllm.lane": "trl_async.engines.vllm.server_lane",
    "trl_async.engines.vllm.weights": "trl_async.engines.vllm.push",
    "trl_async.rollout.custom_rollouts": "trl_async.rollout.rollout_func",
}


class MovedModules:
    """A meta path finder and loader for ``MOVED``'s old names."""

    def find_spec(self, name: str, path=None, target=None):
        if name not in MOVED:
            return None
        new = importlib.util.find_spec(MOVED[name])
        package = new.submodule_search_locations is not None
        return importlib.util.spec_from_loader(name, self, origin=new.origin, is_package=package)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # already executed under its new name

    def get_code(self, name: str):  # ``python -m old.name``
        new = importlib.util.find_spec(MOVED[name])
        return new.loader.get_code(new.name)


def install() -> None:
    """First in line: an old package's submodule (``trl_async.sync.policy``) would otherwise be found on the new
    package's path and loaded a second time, as a different module."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
