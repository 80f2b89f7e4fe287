"""Triton kernels and their launchers. Importing this package imports nothing; each kernel module
imports ``triton`` and is only imported from inside the Triton branch of an ``apex.ops`` entry point."""
