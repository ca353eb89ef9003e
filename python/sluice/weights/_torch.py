"""torch helpers, imported lazily so that ``import sluice`` never needs torch."""

from __future__ import annotations


def torch():
    try:
        import torch as t
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("sluice.weights needs torch (pip install torch)") from e
    return t


def dtype_name(t) -> str:
    s = str(t.dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def describe(t) -> str:
    return f"{dtype_name(t)}{list(t.shape)} on {t.device}"
