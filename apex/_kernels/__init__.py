"""Triton kernels and their launchers. Importing this package imports nothing; each kernel module
imports ``triton`` and is only imported from inside the Triton branch of an ``apex.ops`` entry point.
``_tuning`` (launch configurations and the plan caches emptied with them) imports no Triton: the ops' planned
paths keep their tables there from import on."""
