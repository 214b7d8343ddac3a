"""One registry type for every "name -> implementation" table in cvt (architecture tables,
linear kernels, quantization schemes, output formats, methods): a duplicate name and an unknown
name both fail loudly, the latter listing the known names. A registry whose entries the help
describes (`summarized=True`) refuses an entry without a one-line ``summary``: `cvt --help`
and the docs render `summaries()`, so a new entry cannot go undescribed."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from cvt.errors import CvtError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, error: type[CvtError] = CvtError, summarized: bool = False):
        self.kind, self.error, self.summarized = kind, error, summarized
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        if name in self._items:
            raise self.error(f"{self.kind} {name!r} is registered twice ({self._items[name]!r}, {item!r})")
        summary = getattr(item, "summary", None)
        if self.summarized and not (isinstance(summary, str) and summary.strip() and "\n" not in summary):
            raise self.error(f"{self.kind} {name!r} has no one-line `summary` (the help describes every {self.kind})")
        self._items[name] = item
        return item

    def summaries(self) -> dict[str, str]:
        """{name: its one-line summary}, in registration order."""
        return {n: getattr(item, "summary") for n, item in self._items.items()}

    def register(self, cls: T) -> T:
        """Class decorator: registers `cls` under its `name` attribute."""
        return self.add(getattr(cls, "name"), cls)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r} (known: {', '.join(self.names())})") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def values(self):
        return self._items.values()

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __getitem__(self, name: str) -> T:
        return self.get(name)
