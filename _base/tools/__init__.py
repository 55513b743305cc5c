"""Tools that build the project's artifacts: the embedded model's trainer and its evaluation."""
