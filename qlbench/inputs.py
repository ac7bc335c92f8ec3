"""What people type, parsed once per kind of input, for every command and the library alike (ValueError in one line
naming the input and what is wrong):

    inputs.items("lora, dora", "--methods")        -> ["lora", "dora"]
    inputs.items("lora,,dora", "--methods")        -> ValueError: --methods: an empty item in 'lora,,dora'
    inputs.grid("r=4,8 k=1", ("r", "M", "k"))      -> {"r": (4, 8), "k": (1,)}
"""

from __future__ import annotations


def items(text: str, what: str = "list") -> list[str]:
    """A comma-separated list: each item stripped of whitespace; a list with no item at all ('', ' ', ' , ') -> []
    (each caller says what an empty list means, with the valid choices); ValueError for an empty item beside others
    ('a,,b', 'a,') or an item given twice."""
    out = [v.strip() for v in text.split(",")]
    if not any(out):
        return []
    if "" in out:
        raise ValueError(f"{what}: an empty item in {text!r}")
    if twice := [v for i, v in enumerate(out) if v in out[:i]]:
        raise ValueError(f"{what}: {twice[0]!r} given twice in {text!r}")
    return out


def grid(text: str, axes: tuple[str, ...], what: str = "--grid") -> dict[str, tuple[int, ...]]:
    """'AXIS=V1,V2 AXIS=V1 ...' -> {axis: values}, each value an integer >= 1; ValueError for an empty text, an
    unknown axis (naming the valid ones), an axis given twice, an empty or repeated value, or a value that is not an
    integer >= 1."""
    if not text.strip():
        raise ValueError(f"{what} is empty; write AXIS=V1,V2 with AXIS one of: {', '.join(axes)}")
    out: dict[str, tuple[int, ...]] = {}
    for item in text.split():
        axis, sep, values = item.partition("=")
        if not sep or axis not in axes:
            raise ValueError(f"{what}: bad item {item!r}; write AXIS=V1,V2 with AXIS one of: {', '.join(axes)}")
        if axis in out:
            raise ValueError(f"{what}: axis {axis} given twice")
        parts = items(values, f"{what} axis {axis}")
        try:
            vals = tuple(int(v) for v in parts)
        except ValueError:
            raise ValueError(f"{what} axis {axis}: values must be integers, got {values!r}") from None
        if not vals or min(vals) < 1:
            raise ValueError(f"{what} axis {axis}: give one or more integers >= 1, got {values!r}")
        out[axis] = vals
    return out
