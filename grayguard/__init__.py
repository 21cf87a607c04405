"""What every grayguard package shares: the config schema, the vocabulary, the Prometheus client, the CLI."""
