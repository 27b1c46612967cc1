"""Untrusted code, run sandboxed: ``Sandbox`` (and its ``Limits`` and ``SandboxResult``), the code-execution reward
and the Python-interpreter tool built on it."""

from .isolation import SandboxUnavailable
from .limits import Limits, SandboxResult
from .runner import Sandbox
from .zygote_client import SandboxError

__all__ = ["Limits", "Sandbox", "SandboxError", "SandboxResult", "SandboxUnavailable"]
