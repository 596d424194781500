"""The one error tree of tierstore.

Every error tierstore raises derives from :class:`TierstoreError`. Leaves also derive from
the matching builtin (``CheckpointNotFound`` is a ``FileNotFoundError``), so code that
already handles builtins keeps working. Each error carries what failed as attributes
(``checkpoint``, ``tier``, ``key``, ``rank``) and names it in its message. Backend
errors are translated at the backend boundary with ``raise ... from err``.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

__all__ = [
    "TierstoreError",
    "ConfigError",
    "BackendNotFound",
    "StorageError",
    "ObjectNotFound",
    "PublishConflict",
    "TransientStorageError",
    "NoSpaceLeft",
    "ObjectTooLarge",
    "UnsafePath",
    "CheckpointNotFound",
    "CheckpointExists",
    "UnsafeType",
    "IntegrityError",
    "InvalidManifest",
    "ChecksumMismatch",
    "SaveFailed",
    "MigrationFailed",
    "UnpicklableError",
    "FaultInjected",
]

_CONTEXT_ORDER = ("checkpoint", "file", "key", "tier", "rank")


class TierstoreError(Exception):
    """Root of every error tierstore raises.

    Keyword context (``checkpoint=``, ``tier=``, ``key=``, ``file=``, ``rank=``, plus any
    error-specific fields) is kept as attributes and appended to the message.
    """

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.checkpoint: str | None = None
        self.tier: str | None = None
        self.key: str | None = None
        self.file: str | None = None
        self.rank: int | None = None
        for name, value in context.items():
            setattr(self, name, value)
        self.context = context
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [
            f"{name} {self.context[name]!r}" for name in _CONTEXT_ORDER if self.context.get(name) is not None
        ]
        return f"{self.message} [{', '.join(parts)}]" if parts else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (DCP's PROCESS mode, our subprocess tests):
        # rebuild from message + context rather than from the rendered args.
        return (_rebuild, (type(self), self.message, self.context))


def _rebuild(cls: type[TierstoreError], message: str, context: dict[str, Any]) -> TierstoreError:
    return cls(message, **context)


class ConfigError(TierstoreError, ValueError):
    """Bad arguments or options: an unusable URL, name, option or combination."""


class BackendNotFound(ConfigError):
    """No backend is registered for a URL scheme; the message names what to install."""


class StorageError(TierstoreError, OSError):
    """A storage backend failed; ``tier``/``key`` say where."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """The key does not exist in the tier."""


class PublishConflict(StorageError, FileExistsError):
    """An exclusive publish (or write) found the key already present."""


class TransientStorageError(StorageError):
    """A failure worth retrying: throttling, a dropped connection, a 5xx."""


class ObjectTooLarge(StorageError):
    """A small object (manifest, mark, lease) is larger than any honest one: damaged or hostile."""


class NoSpaceLeft(StorageError):
    """The tier is full (ENOSPC or a quota)."""


class UnsafePath(StorageError, PermissionError):
    """A key escapes its root: absolute, ``..``, or a symbolic link on the way."""


class CheckpointNotFound(TierstoreError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointExists(TierstoreError, FileExistsError):
    """The checkpoint is already committed; committed checkpoints are never overwritten."""


class UnsafeType(TierstoreError, TypeError):
    """A stored non-tensor item holds types outside torch's ``weights_only`` allow-list.

    A refusal by policy, not damage: the checkpoint is intact, and loading an older one would
    silently resume the wrong state, so no resume steps back from it. ``types`` names each
    refused global (``module.qualname``), ``item`` the state dict key; the message says how to
    allow them (``torch.serialization.add_safe_globals``).
    """


class IntegrityError(TierstoreError, ValueError):
    """Stored data failed verification; nothing unverified is ever loaded."""


class InvalidManifest(IntegrityError):
    """A manifest is malformed, unsafe (absolute or ``..`` paths) or fails its self-checksum."""


class ChecksumMismatch(IntegrityError):
    """A file's size or CRC32C differs from what its manifest records.

    Build it with :meth:`size` or :meth:`crc32c`: every verified read reports damage in
    one format (``"CRC32C mismatch: expected 0a1b2c3d, found 00000000 [checkpoint ...,
    file ..., tier ...]"``), whichever caller found it.
    """

    expected: Any
    actual: Any

    @classmethod
    def size(
        cls, expected: int, actual: int, *, checkpoint: str | None, file: str, tier: str | None
    ) -> ChecksumMismatch:
        return cls._of("size", f"{expected} bytes", f"{actual} bytes", checkpoint, file, tier)

    @classmethod
    def crc32c(
        cls, expected: int, actual: int, *, checkpoint: str | None, file: str, tier: str | None
    ) -> ChecksumMismatch:
        return cls._of("CRC32C", f"{expected:08x}", f"{actual:08x}", checkpoint, file, tier)

    @classmethod
    def _of(
        cls, what: str, expected: str, actual: str, checkpoint: str | None, file: str, tier: str | None
    ) -> ChecksumMismatch:
        return cls(
            f"{what} mismatch: expected {expected}, found {actual}",
            checkpoint=checkpoint,
            file=file,
            tier=tier,
            expected=expected,
            actual=actual,
        )


class SaveFailed(TierstoreError, RuntimeError):
    """A checkpoint save failed; raised by the manager's next ``save``/``wait``/``close``.

    ``step`` is the step whose save failed; ``errors`` maps each failing rank (``None``: the
    save as a whole) to its error. The message names every error, with its checkpoint, file
    and tier; ``checkpoint``, ``file`` and ``tier`` are the first error's. All of it survives
    pickling (DCP's PROCESS mode, worker processes): an error that cannot make the round
    trip travels as an :class:`UnpicklableError` with its type name and message.
    """

    step: int | None
    errors: dict[int | None, BaseException]

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        errors: Mapping[int | None, BaseException] | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, step=step, errors=dict(errors or {}), **context)

    def _render(self) -> str:
        return self.message  # it names what failed already; the context would say it twice

    def __reduce__(self) -> tuple[Any, ...]:
        # From the attributes, so one set after construction travels too.
        context = {
            **self.context,
            "step": self.step,
            "errors": {rank: _picklable(err) for rank, err in self.errors.items()},
        }
        context.update(
            {name: getattr(self, name) for name in _CONTEXT_ORDER if getattr(self, name, None) is not None}
        )
        return (_rebuild, (type(self), self.message, context))


class MigrationFailed(TierstoreError, RuntimeError):
    """Checkpoints that did not reach the cold tier: raised by ``CheckpointManager.close``
    (and ``wait``) as save failures are, once they are certain. Nothing is lost: each stays
    committed and pending in the hot tier, and the next job's manager (or
    ``tierstore migrate``) finishes it.

    ``checkpoints`` names them, oldest first; ``errors`` maps each to why ("still uploading
    when close() ran out of time", or the failure the migrator reported).
    """

    checkpoints: tuple[str, ...]
    errors: dict[str, str]

    def __init__(
        self,
        message: str,
        *,
        checkpoints: tuple[str, ...] = (),
        errors: Mapping[str, str] | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, checkpoints=tuple(checkpoints), errors=dict(errors or {}), **context)

    def _render(self) -> str:
        return self.message  # it names the checkpoints and the tiers itself


class UnpicklableError(TierstoreError, RuntimeError):
    """Stands in for an error of :attr:`SaveFailed.errors` that cannot be pickled or
    unpickled (a local class, an ``__init__`` pickle cannot call): ``type_name`` is its
    type's name, and the message is ``"<type_name>: <its message>"``."""

    type_name: str

    @classmethod
    def of(cls, err: BaseException) -> UnpicklableError:
        try:
            text = str(err)
        except Exception:  # a broken __str__ must not lose the rest
            text = "(its message could not be read)"
        name = type(err).__qualname__
        return cls(f"{name}: {text}", type_name=name)


def _picklable(err: BaseException) -> BaseException:
    """``err`` if it survives a pickle round trip, else its :class:`UnpicklableError`."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return UnpicklableError.of(err)
    return err


class FaultInjected(TierstoreError, RuntimeError):
    """Raised by an armed fault point (tests only)."""
