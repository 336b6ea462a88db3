"""Selectors by name: the registry behind ``lilicorr bench --selectors`` (names or class paths)."""

from __future__ import annotations

import importlib

from lilicorr_pl.heads.base import Selector
from lilicorr_pl.heads.domino import DominoHead
from lilicorr_pl.heads.dspark import DSparkHead
from lilicorr_pl.heads.lilicorr import LiLiCorrHead
from lilicorr_pl.heads.top1 import Top1Selector

SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in (Top1Selector, LiLiCorrHead, DominoHead, DSparkHead)}
"""Registered selector classes by their declared :attr:`Selector.name`."""


def selector_class(name: str) -> type[Selector]:
    """The selector class registered as ``name``, or named by a class path ``package.module.Class``.

    Raises ``ValueError`` naming the choices for an unknown name, and for a class path that does not
    import or is not a :class:`Selector`.
    """
    if name in SELECTORS:
        return SELECTORS[name]
    if "." not in name:
        raise ValueError(
            f"unknown selector {name!r}; choose from {', '.join(SELECTORS)} or give a class path "
            "such as lilicorr_pl.heads.LiLiCorrHead"
        )
    module_name, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"selector class path {name!r} does not import ({err}); check the module and class name"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        raise ValueError(f"{name!r} is not a Selector subclass; name a class from lilicorr_pl.heads")
    return cls
