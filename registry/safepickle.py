"""Unpickling that runs nothing from the file: only the names a kind of file may hold resolve.

A pickle calls whatever global it names; Python's documented defence is an Unpickler whose
`find_class` resolves an allow-list and refuses the rest
(https://docs.python.org/3/library/pickle.html#restricting-globals). Torch-free, so the login
side (token-label shape probes) and the trainer (CIFAR batches, DCP metadata) share it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Callable, Iterator
from typing import IO, Any

Allowed = Callable[[str, str], Any]
"""(module, name) -> the object the pickle may use for it, or None: refused."""


class UnsafePickle(pickle.UnpicklingError, ValueError):
    """A file names a global its kind never holds; nothing of it ran. The message names the file."""


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Allowed, path: str, what: str, **kwargs: Any):
        super().__init__(file, **kwargs)
        self._allowed, self._path, self._what = allowed, path, what

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed(module, name)
        if found is None:
            raise UnsafePickle(
                f"{self._path}: names {module}.{name}, which {self._what} never holds; the file "
                "was not loaded and nothing in it ran (it was not written by the tool that writes "
                "this kind of file, or someone changed it): replace it with a copy you trust"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"{self._path}: holds a persistent id {pid!r}; {self._what} has none")


def load(
    file: str | os.PathLike[str] | IO[bytes], allowed: Allowed, what: str,
    path: str | os.PathLike[str] | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    """One pickle from `file` (a path or an open binary file), resolving only what `allowed`
    gives; UnsafePickle naming `path` (default: the file) for any other global."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return RestrictedUnpickler(fh, allowed, str(path or file), what, **kwargs).load()
    label = str(path if path is not None else getattr(file, "name", "<bytes>"))
    return RestrictedUnpickler(file, allowed, label, what, **kwargs).load()


def loads(data: bytes, allowed: Allowed, what: str, path: str) -> Any:
    return load(io.BytesIO(data), allowed, what, path)


def names(table: dict[tuple[str, str], Any]) -> Allowed:
    """An allow-list from a table of (module, name) -> object."""
    return lambda module, name: table.get((module, name))


@contextlib.contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """An UnpicklingError inside (torch.load(weights_only=True) refusing a global) becomes
    UnsafePickle naming `path`: torch's own message names the global, not the file."""
    try:
        yield
    except UnsafePickle:
        raise
    except pickle.UnpicklingError as err:
        raise UnsafePickle(refusal(path, err)) from None


def refusal(path: str | os.PathLike[str], err: BaseException) -> str:
    first = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
    why = first.split("WeightsUnpickler error:")[-1].strip() or type(err).__name__
    return (
        f"{path}: holds more than tensors and plain values ({why}); it was not loaded and "
        "nothing in it ran (it was not written by vitpod, or someone changed it)"
    )
