"""Packaging: the design card's top-level `backends/` folder is installed as `colibri_edge.backends`
(a setuptools package_dir mapping); both package lists are derived by setuptools, data folders
(default_model, profiles) included as packages so their files ship as package data.
Everything else is in pyproject.toml."""
from setuptools import find_namespace_packages, setup

SKIP = ["*.__pycache__", "*.__pycache__.*"]
core = find_namespace_packages(include=["colibri_edge", "colibri_edge.*"], exclude=SKIP)
backends = ["colibri_edge.backends"] + [f"colibri_edge.backends.{p}" for p in
                                        find_namespace_packages("backends", exclude=SKIP)]
setup(packages=core + backends, package_dir={"colibri_edge.backends": "backends"})
