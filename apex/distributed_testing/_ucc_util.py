"""``HAS_UCC`` at Apex's newer path (see :mod:`apex.transformer._ucc_util`)."""

from apex.transformer._ucc_util import HAS_UCC

__all__ = ["HAS_UCC"]
