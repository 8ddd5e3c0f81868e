"""Stand-in for ``vime.rollout``."""
