"""What every grayguard package shares: the config schema, the vocabulary, the Prometheus client, the CLI."""

# The one place the version lives: pyproject.toml reads it (setuptools dynamic version), `grayguard --version`
# prints it, and the deploy manifests' image tags must equal it (tests/deploy/).
__version__ = "0.1.0"
