"""Integrations with training frameworks; each module imports its framework, so import the one you use.

* :mod:`savedhooks.integrations.transformers`: ``transformers.Trainer``.

``import savedhooks`` imports none of them.
"""
