"""The errors hybrid_pack raises on purpose (docs/api.md, "Errors").

Every one of them subclasses :class:`HybridPackError`, itself a :class:`ValueError`, so code that
caught ``ValueError`` before keeps working, and the command line can tell a user's mistake (one
of these, reported in one line) from a bug (anything else, shown with its traceback).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridPackError", "InputError", "BoundaryError", "UnsupportedModelError", "BackendUnavailableError",
           "IsolationError", "MissingExtraError", "UncheckedError"]


class HybridPackError(ValueError):
    """Base of every error hybrid_pack raises on purpose; the message names the field and the fix."""


class InputError(HybridPackError):
    """An argument, tensor, example or setting that hybrid_pack cannot take as given."""


class BoundaryError(InputError):
    """Document boundaries that are malformed or disagree with each other or with the tokens."""


class UnsupportedModelError(HybridPackError):
    """A model (or one of its settings) that cannot be made to keep packed documents apart."""


class BackendUnavailableError(HybridPackError, RuntimeError):
    """A backend that was asked for by name cannot run these inputs here (also a :class:`RuntimeError`)."""


class MissingExtraError(HybridPackError, ImportError):
    """A part of hybrid_pack needs an optional dependency that is not installed (also an :class:`ImportError`).

    Args:
        feature: what was used, e.g. ``"PackedTrainer"``.
        extra: the ``pyproject.toml`` extra that installs the dependency, e.g. ``"hf"``.
        error: the ImportError raised by the missing import.
    """

    def __init__(self, feature: str, extra: str, error: ImportError) -> None:
        missing = error.name or str(error)
        super().__init__(f"{feature} needs the [{extra}] extra ({missing} could not be imported): "
                         f"pip install 'hybrid_pack[{extra}]'")


class IsolationError(HybridPackError, AssertionError):
    """A packed model let one document see another (also an :class:`AssertionError`, for test runners).

    Attributes:
        report: what was measured (an ``IsolationReport`` from the harness, or a guard record), or None.
    """

    def __init__(self, message: Any, report: Any = None) -> None:
        super().__init__(str(message))
        self.report = report if report is not None else (None if isinstance(message, str) else message)


class UncheckedError(HybridPackError, RuntimeError):
    """A guard saw training calls but no packed one, so it checked nothing (the trainer pads or flattens
    without boundary keys): raised with ``action="raise"`` instead of staying silent (docs/api.md §7c)."""
