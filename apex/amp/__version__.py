"""amp's version, as Apex's ``apex.amp.__version__`` module gave it."""

VERSION = (0, 1, 0)
__version__ = ".".join(map(str, VERSION))
