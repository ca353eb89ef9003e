"""Compatibility layers: other engines' APIs on Sluice.

``sluice.compat.mooncake``: Mooncake's ``mooncake.engine.TransferEngine`` (see
docs/mooncake-compat.md). ``SLUICE_MOONCAKE_COMPAT=1`` makes ``import mooncake.engine`` give it.
Importing this package imports no layer; each is its own module.
"""
