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

# The conformance suite and its spec travel as data: pytest collects them from the installed folder.
package_data = {"poot.conformance": ["spec/*.yaml", "spec/sources/*.yaml", "suite/*.py", "suite/pytest.ini",
                                     "README.md"]}

setup(packages=packages, package_dir=package_dir, package_data=package_data)
