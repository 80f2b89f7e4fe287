"""Apex's ``contrib`` namespace: re-exports of apex features under the import paths Apex used there."""
