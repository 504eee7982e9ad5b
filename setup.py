# Metadata lives in pyproject.toml; this file lets older tooling run `pip install -e .`.
from setuptools import setup

setup()
