"""Half-open layer ranges: the unit a stage owns. Pure, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class LayerRange:
    """Layers [start, end) of a model; start < end, both >= 0."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise ValueError(f"LayerRange needs 0 <= start < end, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    @classmethod
    def split(cls, num_layers: int, parts: int) -> list["LayerRange"]:
        """Split [0, num_layers) into `parts` contiguous ranges, sizes differing by at most 1."""
        if not (1 <= parts <= num_layers):
            raise ValueError(f"cannot split {num_layers} layers into {parts} stages")
        base, extra = divmod(num_layers, parts)
        ranges, start = [], 0
        for i in range(parts):
            end = start + base + (1 if i < extra else 0)
            ranges.append(cls(start, end))
            start = end
        return ranges
