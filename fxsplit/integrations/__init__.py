"""Integrations of fxsplit into training frameworks.

Each integration is a subpackage that imports its framework only when it is
used, so ``import fxsplit.integrations.<name>`` works without the framework
installed and a use without it raises ``ImportError`` naming the extra to
install.

* :mod:`fxsplit.integrations.torchtitan`: torchtitan's pipeline builder with
  fxsplit's pipeline stages, for zero-bubble schedules over blocks compiled
  with ``--compile.backend fxsplit``.
"""
