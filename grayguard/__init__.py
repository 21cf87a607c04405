"""What every grayguard package shares: the config schema, the vocabulary, the Prometheus client, the CLI.

Every component is imported as `grayguard.<component>` (grayguard.controller, grayguard.rules, ...). The wheel puts
them under this package (pyproject.toml's package-dir); the source tree keeps them as top-level folders beside it,
so there this package's search path takes in the tree's root, and the same import names work unbuilt (tests,
`PYTHONPATH=. python -m grayguard.localstack.vllm_model` in the vLLM environment). Nothing imports the bare folder
names (tests/test_layout.py).
"""

from pathlib import Path as _Path

# The one place the version lives: pyproject.toml reads it (setuptools dynamic version), `grayguard --version`
# prints it, and the deploy manifests' image tags must equal it (tests/deploy/).
__version__ = "0.1.0"

# the components, as the wheel maps them under this package
COMPONENTS = ("controller", "exporters", "rules", "dashboards", "sim", "bench", "localstack", "demo")

_TREE = _Path(__file__).resolve().parent.parent
if (_TREE / "pyproject.toml").is_file() and (_TREE / "controller" / "__init__.py").is_file():  # the source tree
    __path__.append(str(_TREE))  # noqa: F821  (a package's __path__, set by the import system)
