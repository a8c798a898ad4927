"""``specgate tune``: measure speculation on the operator's own traffic, recommend a method and
k per model, write the recommendation to a configuration file, and watch acceptance drift."""
