"""Launch configurations measured per GPU (written by ``benchmarks/sweep_kernels.py --write``).

``TABLES[device name][op]`` is a list of ``{"itemsize", "key", "config", "gbps"}`` entries: the fastest
configuration of ``op`` for inputs of that element size and ``key = (rows, *sizes)``, and the GB/s it
reached. Empty until the sweep has run on a GPU: the launchers' formulas apply.
"""

TABLES: dict[str, dict[str, list[dict]]] = {}
