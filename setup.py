"""Maps the top-level folders under one import namespace, `poot`.

engine/ -> poot.engine, server/ -> poot.server, conformance/ -> poot.conformance,
loadtests/ -> poot.loadtests. Everything else is declared in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = {"engine": "poot.engine", "server": "poot.server",
           "conformance": "poot.conformance", "loadtests": "poot.loadtests"}

packages = ["poot"]
package_dir = {"poot": "poot"}
for folder, name in FOLDERS.items():
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
