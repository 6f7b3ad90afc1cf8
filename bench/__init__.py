"""pacerd benchmarks (not tests): see README.md in this folder."""

from __future__ import annotations
