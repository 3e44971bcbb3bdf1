"""Maps the fixed source layout onto import names; everything else is in pyproject.toml."""

from setuptools import find_packages, setup

# import name -> directory
ROOTS = {
    "sparrow": "framework",
    "sparrow.hookspecs": "hookspecs",
    "sparrow_schedulers": "plugins/schedulers",
    "sparrow_cpu": "plugins/cpu",
    "sparrow_cuda": "plugins/builtin_cuda",
}

packages, package_dir = [], {}
for name, path in ROOTS.items():
    package_dir[name] = path
    packages.append(name)
    packages.extend(f"{name}.{sub}" for sub in find_packages(path))

setup(packages=packages, package_dir=package_dir)
