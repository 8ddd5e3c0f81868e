"""Stand-in for ``vime.utils``."""
