"""Upstream's test helpers for ``apex.transformer``: distributed test bases, toy models, the standalone
GPT and BERT models and their global arguments."""
