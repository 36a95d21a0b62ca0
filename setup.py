"""Package discovery for the folder-per-subpackage layout (see pyproject.toml's package-dir).

Each top-level folder installs as megagraph.<folder>; nested packages are found here so that a new
sub-folder with an __init__.py never needs a manual entry in pyproject.toml.
"""
from setuptools import find_packages, setup

ROOTS = {"megagraph": "cli", "megagraph.graph": "graph", "megagraph.passes": "passes",
         "megagraph.runtime": "runtime", "megagraph.models": "models",
         "megagraph.kernels": "kernels", "megagraph.configs": "configs"}

packages, package_dir = [], {}
for pkg, folder in ROOTS.items():
    packages.append(pkg)
    package_dir[pkg] = folder
    for sub in find_packages(folder):
        packages.append(f"{pkg}.{sub}")
        package_dir[f"{pkg}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
